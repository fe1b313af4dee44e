"""A trainer for the weight-update tests, run as its own process:

    python trainer_process.py MODEL_DIR OUT_DIR PORT WORLD_SIZE BUCKET_BYTES

Rank 0 of a gloo group on 127.0.0.1:PORT (group "rl"): it takes one SGD step of Hugging
Face's model on a language-modelling loss, saves the result to OUT_DIR (so the test has a
reference), writes OUT_DIR/update.json (names, dtypes, shapes), broadcasts the weights with
Baton's bucketing, and leaves the group. With DIE_AFTER, it dies (exit 3) once that many
broadcasts (the plan's header included) are done: a trainer lost mid-transfer. With
BATON_TRAINER_FLAT=1 in its environment it sends from `FlatWeights` (no flattening).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from baton.services.engine.execution.weight_sync import FlatWeights, WeightSyncGroup, broadcast_weights, describe
from transformers import AutoModelForCausalLM


def main(model_dir: str, out_dir: str, port: int, world_size: int, bucket_bytes: int, die_after: int | None) -> None:
    torch.manual_seed(0)
    group = WeightSyncGroup("127.0.0.1", port, 0, world_size, "rl", timeout_s=120)
    if die_after is not None:
        group.broadcast_async = _dying_after(group.broadcast_async, die_after)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = torch.randint(0, model.config.vocab_size, (4, 32))
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 5.0 * param.grad  # a big step, so greedy outputs change
    model.save_pretrained(out_dir)
    named = [(name, param.detach()) for name, param in model.named_parameters()]  # a tied head once
    names, dtypes, shapes = describe(named)
    meta = {"names": names, "dtypes": [str(d) for d in dtypes], "shapes": shapes, "bucket_bytes": bucket_bytes}
    with open(f"{out_dir}/update.json.tmp", "w") as f:
        json.dump(meta, f)
    os.rename(f"{out_dir}/update.json.tmp", f"{out_dir}/update.json")
    if os.environ.get("BATON_TRAINER_FLAT") == "1":
        FlatWeights(named, bucket_bytes).broadcast(group)  # the zero-copy trainer path
    else:
        broadcast_weights(group, named, bucket_bytes)
    group.destroy()


def _dying_after(broadcast_async, num_broadcasts: int):
    done = []

    def broadcast(tensor, src=0):
        if len(done) == num_broadcasts:
            done[-1].wait()
            os._exit(3)
        done.append(broadcast_async(tensor, src))
        return done[-1]

    return broadcast


if __name__ == "__main__":
    model_dir, out_dir, port, world_size, bucket_bytes, *die_after = sys.argv[1:]
    main(model_dir, out_dir, int(port), int(world_size), int(bucket_bytes), int(die_after[0]) if die_after else None)
