"""RL rollouts against a running, disaggregated Baton: sample, score, step, push, repeat.

    python examples/rl_rollout.py [--steps 3] [--samples 8]

What it does, on this machine, with a tiny random model (nothing downloaded):
  1. writes the model (`baton make-tiny-model`), starts `baton serve` on it (configs/local.yaml:
     1 prefill + 1 decode replica, local Redis), waits for it;
  2. the trainer (this process, Hugging Face transformers in float32) joins Baton's engine
     ranks in one gloo group: GET /weight_update_ranks, then POST /init_weights_update_group
     while it joins as rank 0;
  3. each step: n samples per prompt with their logprobs (POST /v1/completions, n=8), checked
     against the trainer's own logprobs of the same tokens (the weights are the same); a toy
     reward (how many of a sample's tokens are in the first half of the vocabulary); one
     REINFORCE step on the trainer's model; the new weights pushed to every engine rank
     (POST /update_weights_from_distributed beside `broadcast_weights`), generation paused
     around it; the next rollout reports the new weight_version;
  4. at the end, Baton's greedy tokens equal the trainer's model's, and the server stops.

It prints one line per step (reward, samples/s, update seconds) and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def rollout(policy, env):", "The reward of a sample is"]
MAX_TOKENS = 16
LOGPROB_TOLERANCE = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, run_dir: Path) -> tuple[subprocess.Popen, str]:
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = free_port()
    config["server"].update(http_host="127.0.0.1", http_port=port, grpc_port=free_port())
    config["engine"]["model"]["max_model_len"] = 512
    path = run_dir / "baton.yaml"
    path.write_text(yaml.safe_dump(config))
    baton = Path(sys.executable).parent / "baton"
    log = open(run_dir / "server.log", "w")  # noqa: SIM115 - the server's lifetime
    cmd = [str(baton), "serve", "--config", str(path), "--model", str(model_dir), "--grace-period", "5"]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"baton serve did not start; see {run_dir / 'server.log'}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1)


def engine_ranks(url: str, timeout_s: float = 120) -> int:
    """The engine ranks a trainer's group takes, once every replica answers: the HTTP port (the
    gateway replica's, under direct ingress) answers while engine replicas may still start."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = httpx.get(f"{url}/weight_update_ranks", timeout=30)
        if answer.status_code == 200:
            return answer.json()["num_engine_ranks"]
        if time.monotonic() > deadline:
            raise SystemExit(f"/weight_update_ranks: {answer.status_code} {answer.text}")
        time.sleep(1)


def post(url: str, path: str, body: dict) -> dict:
    answer = httpx.post(f"{url}{path}", json=body, timeout=300)
    if answer.status_code != 200:
        raise SystemExit(f"{path}: {answer.status_code} {answer.text}")
    return answer.json()


def rollout(url: str, model_name: str, samples: int, seed: int) -> dict:
    body = {"model": model_name, "prompt": PROMPTS, "n": samples, "max_tokens": MAX_TOKENS, "temperature": 1.0}
    return post(url, "/v1/completions", {**body, "logprobs": 1, "seed": seed, "return_token_ids": True})


def sequence_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """The trainer's log-probability of each sampled token (teacher forcing)."""
    ids = torch.tensor([prompt_ids + token_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def push_weights(url: str, model, group, version: str) -> float:
    from baton.services.engine.execution.weight_sync import broadcast_weights, describe

    named = [(name, param.detach()) for name, param in model.named_parameters()]
    names, dtypes, shapes = describe(named)
    body = {"names": names, "dtypes": [str(d) for d in dtypes], "shapes": shapes, "weight_version": version}
    body["group_name"] = "rl"
    start = time.monotonic()
    post(url, "/pause_generation", {"mode": "wait"})
    answer: dict = {}
    receiving = threading.Thread(target=lambda: answer.update(post(url, "/update_weights_from_distributed", body)))
    receiving.start()
    broadcast_weights(group, named)
    receiving.join()
    post(url, "/continue_generation", {})
    if answer.get("weight_version") != version:
        raise SystemExit(f"the update answered {answer}")
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (n)")
    args = parser.parse_args()

    from baton.services.engine.execution.weight_sync import WeightSyncGroup
    from baton.services.model.tiny import make_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = Path(tempfile.mkdtemp(prefix="baton-rl-"))
    model_dir = make_tiny_model(run_dir / "model")
    server, url = start_server(model_dir, run_dir)
    try:
        model_name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        half_vocab = model.config.vocab_size // 2

        num_ranks = engine_ranks(url)
        port, world_size = free_port(), num_ranks + 1
        init = {"master_address": "127.0.0.1", "master_port": port, "world_size": world_size, "group_name": "rl"}
        joining = threading.Thread(target=post, args=(url, "/init_weights_update_group", init))
        joining.start()
        group = WeightSyncGroup("127.0.0.1", port, 0, world_size, "rl", timeout_s=120)
        joining.join()

        version = "0"
        for step in range(args.steps):
            start = time.monotonic()
            answer = rollout(url, model_name, args.samples, seed=step)
            rollout_s = time.monotonic() - start
            if answer["weight_version"] != version:
                raise SystemExit(f"step {step}: rollout from weights {answer['weight_version']}, expected {version}")
            loss, rewards, worst = torch.zeros(()), [], 0.0
            for choice in answer["choices"]:
                prompt_ids = tokenizer.encode(PROMPTS[choice["index"] // args.samples])
                token_ids = choice["token_ids"]
                logprobs = sequence_logprobs(model, prompt_ids, token_ids)
                served = torch.tensor(choice["logprobs"]["token_logprobs"])
                worst = max(worst, (logprobs.detach() - served).abs().max().item())
                rewards.append(sum(t < half_vocab for t in token_ids) / len(token_ids))
                loss = loss - (rewards[-1] - 0.5) * logprobs.sum()
            if worst > LOGPROB_TOLERANCE:
                raise SystemExit(f"step {step}: Baton's logprobs differ from the trainer's by {worst:.2e}")
            optimizer.zero_grad()
            (loss / len(rewards)).backward()
            optimizer.step()
            version = f"step-{step + 1}"
            update_s = push_weights(url, model, group, version)
            num_samples = len(answer["choices"])
            print(
                f"step {step}: mean reward {sum(rewards) / num_samples:.3f} (first sample "
                f"{answer['choices'][0]['token_ids'][:4]}...), {num_samples} samples at "
                f"{num_samples / rollout_s:.1f}/s, logprobs within {worst:.1e} of the trainer's, "
                f"weights pushed in {update_s:.2f}s -> {version}",
                flush=True,
            )

        prompt_ids = tokenizer.encode(PROMPTS[0])
        body = {"model": model_name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
        greedy = post(url, "/v1/completions", {**body, "ignore_eos": True, "return_token_ids": True})
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
            )[0, len(prompt_ids) :].tolist()
        if greedy["choices"][0]["token_ids"] != expected or greedy["weight_version"] != version:
            raise SystemExit(f"after the updates Baton's greedy tokens differ from the trainer's model's: {greedy}")
        print(f"greedy tokens after {args.steps} updates equal the trainer's model's ({version})")
        post(url, "/destroy_weights_update_group", {"group_name": "rl"})
        group.destroy()
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
