"""Train HuggingFace families with myelin and with plain HF; record both, and the way out.

Run by tests/hf/test_hf_pipeline.py as `myelin run -n N hf_pipeline.py --out DIR CASE...`,
where CASE is family:stages[:how] and how is
  eager           the model as built (default);
  meta            built under myelin.init_empty() from its config, weights= a folder that
                  HF's save_pretrained wrote in many small shards (the reference loads it
                  with from_pretrained);
  checkpointing   model.gradient_checkpointing_enable() before wrapping;
  whole           one microbatch per step;
  compiled        passed as torch.compile(model, backend="aot_eager"): each stage compiles
                  its blocks (aot_eager keeps eager numerics, so results stay bit for bit);
  step            tied_grads="step" (tied gradients summed once per step, not bit for bit);
                  every other case runs with tied_grads="microbatch";
  dropout         GPT-2 with every dropout at DROPOUT: no plain-HF reference (its masks
                  come from torch's generator), so the test compares runs at other splits
                  (losses and `weights`, each parameter's float64 sum, on rank 0).
Every case uses all N processes (stages = N).
"""

import argparse
import functools
import json
import os
import tempfile
from pathlib import Path

import hf_families as fam
import safetensors
import torch
import transformers as tf

import myelin

DROPOUT = 0.2


def run_case(case, scratch):
    family, stages, *more = case.split(":")
    how = more[0] if more else "eager"
    stages = int(stages)
    microbatches = 1 if how == "whole" else fam.MICROBATCHES
    result = {}
    weights = None
    if how == "meta":
        weights = scratch / f"{family}-initial"
        if int(os.environ["RANK"]) == 0:
            fam.build(family).save_pretrained(weights, max_shard_size="20KB")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        with myelin.init_empty():
            model = tf.AutoModelForCausalLM.from_config(fam.config(family))
        reference = tf.AutoModelForCausalLM.from_pretrained(weights)
    elif how == "dropout":
        model, reference = fam.build(family, DROPOUT), None
    else:
        model, reference = fam.build(family), fam.build(family)
        if how == "checkpointing":
            model.gradient_checkpointing_enable()
    given = torch.compile(model, backend="aot_eager") if how == "compiled" else model
    opened = []
    real_open = safetensors.safe_open

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    safetensors.safe_open = spy
    try:
        trainer = myelin.Trainer(
            given,
            functools.partial(torch.optim.AdamW, lr=fam.LR),
            stages=stages,
            microbatches=microbatches,
            weights=weights,
            timeout=60,
            tied_grads="step" if how == "step" else "microbatch",
        )
    finally:
        safetensors.safe_open = real_open
    with trainer:
        losses = []
        for step in range(fam.STEPS):
            ids, mask, labels = fam.batch(step)
            losses.append(trainer.step((ids, mask), labels))
        result["losses"] = losses
        result["stage"] = trainer.stage
        if reference is None:
            state = trainer.state_dict()
            if state is not None:
                result["weights"] = {k: float(v.double().sum()) for k, v in state.items()}
            return result
        result["ref_losses"] = fam.train_plain(reference, microbatches=microbatches)
        if how == "compiled":
            result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if how == "meta":
            index = json.loads((weights / "model.safetensors.index.json").read_text())["weight_map"]
            mine = {k for k, p in model.state_dict(keep_vars=True).items() if not p.is_meta}
            tied = model.all_tied_weights_keys if model.config.tie_word_embeddings else {}
            result["opened"] = sorted(set(opened))
            result["needed"] = sorted({index[k] if k in index else index[tied[k]] for k in mine})
            result["held"] = sorted(mine)
            result["keys"] = sorted(model.state_dict(keep_vars=True))
            result["files"] = len(set(index.values()))
        state = trainer.state_dict()
        out = scratch / f"{family}-{stages}-{how}-trained"
        trainer.save_pretrained(out)
        if state is not None:
            want = reference.state_dict()
            result["param_diff"] = fam.max_diff(state, want)
            result["param_equal"] = all(torch.equal(state[k], want[k]) for k in want)
            fresh = fam.build(family)
            fresh.load_state_dict(state, strict=True)
            loaded = tf.AutoModelForCausalLM.from_pretrained(out)
            result["pretrained_diff"] = fam.max_diff(loaded.state_dict(), want)
            result["pretrained_tied"] = (
                loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
            )
            result["pretrained_files"] = sorted(p.name for p in out.iterdir())
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tf.logging.set_verbosity_error()
    scratch = Path(os.environ.get("HF_SCRATCH") or tempfile.mkdtemp())
    results = {case: run_case(case, scratch) for case in args.cases}
    with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
