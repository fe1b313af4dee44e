"""Speculative decoding (n-gram drafts, a draft model, Medusa heads, an EAGLE drafter) against the same engine without it, one run.

    python bench/speculative.py [--quick] [--k 3] [--only NAME ...]

TPOT at concurrency 1 (requests one at a time) and 8 (eight at once), speculative vs not, on
the same requests, the two engines alternating run after run; each TPOT is the mean over
the run's requests of (finish - first token) / (tokens - 1), and the headline per mode is its
fastest run (other work on a shared machine only ever adds time). Beside each speedup: the
acceptance rate (accepted / verified drafts) and the mean acceptance length (tokens emitted
per verification pass).

Random models accept almost nothing: the bench model's greedy output never repeats an
n-gram in 256 tokens, so n-gram lookup finds nothing to draft. The workloads:

  cycle     a copy of the bench model whose layers add nothing to the residual stream
            (o_proj and down_proj zeroed; compute per step unchanged) and whose LM head
            maps each token to its successor on a fixed permutation of 32-token cycles, so
            greedy output walks a cycle: after one lap every draft is right. The ceiling.
  cycle-T   the same model with its LM head scaled down, sampled at temperature 1: the
            successor is drawn with probability ~0.7, and a miss leaves the cycle for
            another one (drafts then wait for the next lap). Partial acceptance.
  random    the bench model, random prompts: no n-gram matches, no drafts: the cost of
            looking for them.
  reject    the bench model with one-token lookups (prompt_lookup_min 1) over 512-token
            random prompts: nearly every step verifies drafts and nearly all are rejected.
            The worst case.

With `method: draft_model`:

  draft=target   the bench model drafting for itself, random prompts, greedy: every draft
                 is accepted (the mechanism's ceiling), but each draft pass costs a target
                 decode, so it cannot pay.
  draft-cycle    the cycle model as target, drafted by a one-layer copy of it (its layers
                 add nothing, so the copy predicts exactly what the target does, at an
                 eighth of the layers): full acceptance from a cheap draft.
  draft-small    the bench model drafted by a small random model with its tokenizer (2
                 layers, hidden 128): near-zero acceptance, the cost of a useless draft.

With heads on the target's hidden states (`method: medusa` / `eagle`, `speculative.heads`):

  medusa-cycle   the cycle model with Medusa heads that agree with it (ResBlocks zero, head
                 i's LM head the target's shifted i + 1 places along the cycles): full
                 acceptance from k small matmuls on one hidden state.
  medusa-random  the bench model with random Medusa heads: near-zero acceptance.
  eagle-cycle    the cycle model with an EAGLE-1 drafter whose fc passes the next token's
                 embedding through and whose layer adds nothing: full acceptance.
  eagle-random   the bench model with a random EAGLE-1 drafter: near-zero acceptance.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from baton.services.engine import LLM, SamplingParams
from common import REPO, bench_model
from safetensors.torch import load_file, save_file

OUT = REPO / ".baton" / "bench-speculative"
CYCLE = 32


@dataclass(frozen=True)
class Workload:
    name: str
    model: Path
    prompts: list[list[int]]
    params: SamplingParams
    lookup: tuple[int, int] = (2, 5)  # ngram: prompt_lookup_min, prompt_lookup_max
    draft: Path | None = None  # draft_model: the draft's folder (None: ngram)
    heads: tuple[str, Path] | None = None  # ("medusa" | "eagle", the heads' folder)


def cyclic_model(dst: Path, logit_scale: float, seed: int = 0) -> Path:
    """The bench model made to walk fixed 32-token cycles (see the module docstring)."""
    if (dst / "model.safetensors").exists():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(bench_model(), dst)
    weights = load_file(dst / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"]
    order = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))
    successor = torch.empty(embed.shape[0], dtype=torch.long)
    for start in range(0, embed.shape[0], CYCLE):
        cycle = order[start : start + CYCLE]
        successor[cycle] = torch.roll(cycle, -1)
    lm_head = torch.empty_like(weights["lm_head.weight"])
    lm_head[successor] = embed * logit_scale  # the logit of succ(x) peaks when the hidden state is x
    weights["lm_head.weight"] = lm_head
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def shallow_copy(src: Path, dst: Path, num_layers: int) -> Path:
    """`src` with only its first `num_layers` decoder layers (the draft of draft-cycle)."""
    if (dst / "model.safetensors").exists():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(dst / "model.safetensors")
    kept = {
        name: w
        for name, w in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def cycle_successor(vocab_size: int, seed: int = 0) -> torch.Tensor:
    """succ on cyclic_model's cycles (the same permutation)."""
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    successor = torch.empty(vocab_size, dtype=torch.long)
    for start in range(0, vocab_size, CYCLE):
        successor[order[start : start + CYCLE]] = torch.roll(order[start : start + CYCLE], -1)
    return successor


def medusa_heads(dst: Path, target: Path, num_heads: int, agree: bool) -> Path:
    """Medusa heads in FasterDecoding's layout (medusa_lm_head.safetensors) for `target`:
    random, or agreeing with the cycle model (head i's LM head is the target's, its rows
    moved i + 1 places along the cycles; ResBlocks zero, so each is the identity)."""
    if (dst / "medusa_lm_head.safetensors").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    lm_head = load_file(target / "model.safetensors")["lm_head.weight"]
    vocab, hidden = lm_head.shape
    successor, generator = cycle_successor(vocab), torch.Generator().manual_seed(1)
    tensors, shift = {}, torch.arange(vocab)
    for i in range(num_heads):
        shift = successor[shift]
        if agree:
            head = torch.empty_like(lm_head)
            head[shift] = lm_head
        else:
            head = 0.1 * torch.randn(vocab, hidden, generator=generator)
        scale = 0.0 if agree else 0.05
        tensors[f"{i}.0.linear.weight"] = scale * torch.randn(hidden, hidden, generator=generator)
        tensors[f"{i}.0.linear.bias"] = scale * torch.randn(hidden, generator=generator)
        tensors[f"{i}.1.weight"] = head
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "hidden_size": hidden, "vocab_size": vocab}
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "medusa_lm_head.safetensors")
    return dst


def eagle_drafter(dst: Path, target: Path, agree: bool) -> Path:
    """An EAGLE-1 drafter in the public layout for `target`: random, or agreeing with the
    cycle model (fc passes the next token's embedding through; o_proj, down_proj zero)."""
    if (dst / "model.safetensors").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    config = {**json.loads((target / "config.json").read_text()), "num_hidden_layers": 1}
    weights = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(2)
    tensors = {}
    for name, w in weights.items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            kept = name.removeprefix("model.")
            tensors[kept] = torch.zeros_like(w) if agree and name.endswith(("o_proj.weight", "down_proj.weight")) else w
    hidden = config["hidden_size"]
    if agree:
        tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    else:
        tensors["fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, dst / "model.safetensors")
    return dst


def small_draft(dst: Path) -> Path:
    """A small random model with the bench model's tokenizer (same vocabulary, same training)."""
    from baton.services.model.tiny import make_tiny_model

    if not (dst / "model.safetensors").exists():
        make_tiny_model(
            dst, preset="bench", seed=1, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        )  # fmt: skip
    return dst


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(length)] for _ in range(num)]


def workloads(quick: bool) -> list[Workload]:
    n_out = 64 if quick else 128
    greedy = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=n_out, temperature=1.0, ignore_eos=True, seed=0)
    num = 8
    cycle = cyclic_model(OUT / "cycle", 1.0)
    return [
        Workload("cycle", cycle, random_prompts(num, 128, 1), greedy),
        Workload("cycle-T", cyclic_model(OUT / "cycle-t", 0.24), random_prompts(num, 128, 2), sampled),
        Workload("random", bench_model(), random_prompts(num, 128, 3), greedy),
        Workload("reject", bench_model(), random_prompts(num, 512, 4), greedy, (1, 3)),
        Workload("draft=target", bench_model(), random_prompts(num, 128, 5), greedy, draft=bench_model()),
        Workload(
            "draft-cycle", cycle, random_prompts(num, 128, 6), greedy, draft=shallow_copy(cycle, OUT / "cycle-1", 1)
        ),
        Workload("draft-small", bench_model(), random_prompts(num, 128, 7), greedy, draft=small_draft(OUT / "small")),
        Workload(
            "medusa-cycle", cycle, random_prompts(num, 128, 8), greedy,
            heads=("medusa", medusa_heads(OUT / "medusa-cycle", cycle, 3, agree=True)),
        ),
        Workload(
            "medusa-random", bench_model(), random_prompts(num, 128, 9), greedy,
            heads=("medusa", medusa_heads(OUT / "medusa-random", bench_model(), 3, agree=False)),
        ),
        Workload(
            "eagle-cycle", cycle, random_prompts(num, 128, 10), greedy,
            heads=("eagle", eagle_drafter(OUT / "eagle-cycle", cycle, agree=True)),
        ),
        Workload(
            "eagle-random", bench_model(), random_prompts(num, 128, 11), greedy,
            heads=("eagle", eagle_drafter(OUT / "eagle-random", bench_model(), agree=False)),
        ),
    ]  # fmt: skip


def tpot(outputs) -> float:
    per_request = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
        for o in outputs
        if len(o.token_ids) > 1
    ]
    return statistics.mean(per_request)


def run(llm: LLM, workload: Workload, concurrency: int) -> tuple[float, list[list[int]]]:
    """Mean TPOT over the workload's requests, `concurrency` at a time; and the outputs."""
    params = [
        SamplingParams(**{**_fields(workload.params), "seed": i if workload.params.seed is not None else None})
        for i in range(len(workload.prompts))
    ]
    tpots, tokens = [], []
    for start in range(0, len(workload.prompts), concurrency):
        outs = llm.generate(workload.prompts[start : start + concurrency], params[start : start + concurrency])
        tpots.append(tpot(outs) * len(outs))
        tokens.extend(o.token_ids for o in outs)
    return sum(tpots) / len(workload.prompts), tokens


def _fields(params: SamplingParams) -> dict:
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "ignore_eos": params.ignore_eos,
        "seed": params.seed,
    }


def bench(workload: Workload, k: int, runs: int) -> None:
    common = dict(num_kv_blocks=4096, num_threads=2, max_model_len=2048)
    plain = LLM(model=str(workload.model), **common)
    if workload.heads is not None:
        method = dict(speculative_method=workload.heads[0], heads=str(workload.heads[1]))
    elif workload.draft is None:
        lo, hi = workload.lookup
        method = dict(speculative_method="ngram", prompt_lookup_min=lo, prompt_lookup_max=hi)
    else:
        method = dict(speculative_method="draft_model", draft_model=str(workload.draft))
    spec = LLM(model=str(workload.model), num_speculative_tokens=k, **method, **common)
    for llm in (plain, spec):  # warm-up
        llm.generate(workload.prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for concurrency in (1, 8):
        stats = spec.core.speculator.stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        times: dict[str, list[float]] = {"plain": [], "spec": []}
        outputs = {}
        for _ in range(runs):
            for name, llm in (("plain", plain), ("spec", spec)):
                t, outputs[name] = run(llm, workload, concurrency)
                times[name].append(t)
        drafts = stats.num_drafts - before[0]
        draft_tokens, accepted = stats.num_draft_tokens - before[1], stats.num_accepted_tokens - before[2]
        rate = accepted / draft_tokens if draft_tokens else 0.0
        length = 1 + accepted / drafts if drafts else 1.0
        same = "greedy outputs equal" if workload.params.is_greedy else "sampled"
        if workload.params.is_greedy:
            assert outputs["plain"] == outputs["spec"], "speculative greedy output differs from the plain engine's"
        best_plain, best_spec = min(times["plain"]), min(times["spec"])
        ratios = [s / p for s, p in zip(times["spec"], times["plain"])]
        print(
            f"{workload.name:12} conc {concurrency}: TPOT plain {best_plain * 1e3:6.2f} ms, spec {best_spec * 1e3:6.2f} ms"
            f" -> {best_spec / best_plain:5.2f}x (median paired {statistics.median(ratios):5.2f}x);"
            f" acceptance {rate:4.2f}, mean acceptance length {length:4.2f},"
            f" {draft_tokens / max(runs, 1):7.0f} drafts/run; {same}",
            flush=True,
        )
    plain.core.shutdown()
    spec.core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter outputs, one run per mode")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (alternating)")
    parser.add_argument("--only", nargs="*", default=None, help="workload names")
    args = parser.parse_args()
    start = time.monotonic()
    for workload in workloads(args.quick):
        if args.only and workload.name not in args.only:
            continue
        bench(workload, args.k, 1 if args.quick else args.runs)
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
