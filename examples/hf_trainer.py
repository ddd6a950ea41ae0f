"""A transformers.Trainer script trained under cpvlm's context parallelism.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --cp 2 --output-dir out   # tiny Qwen3-VL, CPU
    torchrun --nproc-per-node 4 examples/hf_trainer.py --cp 2 --output-dir out --grad-accum 2
    torchrun --nproc-per-node 8 examples/hf_trainer.py --cp 4 --model /path/to/checkpoint ...
    torchrun --nproc-per-node 2 examples/hf_trainer.py --cp 2 --ep 2 --model qwen3-vl-moe-tiny ...
    torchrun --nproc-per-node 4 examples/hf_trainer.py --cp 2 --tp 2 --output-dir out

An ordinary Trainer script (synthetic image+text samples in the model family's layout, a padding
collator, optional LoRA through PEFT); the lines marked ``# cpvlm`` are all that CP changes.
The world is dp x cp x tp ranks, CP groups of cp ranks; the global batch of a step is
batch-size x grad-accum x dp samples. Writes Trainer's trainer_state.json and, at the end,
``trainer.save_model()`` (the full model, or the LoRA adapter) into --output-dir.
"""

import argparse
import os

import torch
from transformers import Trainer, TrainingArguments, set_seed  # noqa: F401  (the usual imports)

from cpvlm.hf import SampleSpec, build_model, synthetic_batch
from cpvlm.hf.trainer import ContextParallelTrainer  # cpvlm

VISION_KEYS = ("pixel_values", "image_grid_thw")
ANSWER = 3


def synthetic_samples(config, count: int, dtype: torch.dtype, text_lens=None, seed=0) -> list[dict]:
    """``count`` one-row samples of different lengths, two of every three with an image."""
    samples = []
    for i in range(count):
        images = (((4, 4),), ((8, 4),), ())[i % 3]
        text_len = 10 + (7 * i) % 13 if text_lens is None else text_lens[i]
        batch = synthetic_batch(
            config, [SampleSpec(images, (), text_len)], seed=seed + i, dtype=dtype
        )
        samples.append({k: v[0] if k not in VISION_KEYS else v for k, v in batch.items()})
    return samples


def eval_samples(config, dtype: torch.dtype) -> list[dict]:
    """Two samples of different lengths scored on their answers, the last ``ANSWER`` tokens (so a
    batch of both has padding, and at cp 2 the middle half of the sequence, one CP rank's share,
    holds no label)."""
    samples = synthetic_samples(config, 2, dtype, text_lens=(30, 27), seed=1000)
    for s in samples:
        s["labels"][: len(s["labels"]) - ANSWER] = -100
    return samples


def collate(features: list[dict], pad_token_id: int = 0) -> dict:
    """Right-pad the sequences of a batch; concatenate its images."""
    length = max(len(f["input_ids"]) for f in features)
    pad = {"input_ids": pad_token_id, "labels": -100, "attention_mask": 0, "mm_token_type_ids": 0}
    batch = {
        key: torch.stack(
            [torch.nn.functional.pad(f[key], (0, length - len(f[key])), value=v) for f in features]
        )
        for key, v in pad.items()
    }
    for key in VISION_KEYS:
        if any(key in f for f in features):
            batch[key] = torch.cat([f[key] for f in features if key in f])
    return batch


def lora(model, rank: int):
    from peft import LoraConfig, get_peft_model

    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-vl-tiny", help="a tiny model or a checkpoint dir")
    parser.add_argument("--cp", type=int, default=2, help="ranks per sequence; dp = world / cp")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE models)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism; dp = world/cp/tp")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1, help="per DP replica")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--lora-r", type=int, default=0, help="train a LoRA adapter of this rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--pack", action="store_true", help="pack each batch into one row")
    parser.add_argument("--eval", action="store_true", help="evaluate after training")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint")
    parser.add_argument("--fsdp", action="store_true", help="accelerate's FSDP2 over all ranks")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        remove_unused_columns=False,
        per_device_eval_batch_size=max(
            1, 2 * args.cp * args.tp // int(os.environ.get("WORLD_SIZE", 1))
        ),
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # gloo on CPU
        # FSDP2 sharded over every rank (dp x cp), the full state dict gathered by save_model()
        fsdp="full_shard" if args.fsdp else "",
        fsdp_config={"version": 2, "state_dict_type": "FULL_STATE_DICT"} if args.fsdp else None,
    )
    model = build_model(args.model, dtype=dtype)
    if args.lora_r:
        set_seed(training_args.seed)  # the adapter's random init, the same in every run
        model = lora(model, args.lora_r)
    pad_id = model.config.text_config.pad_token_id or 0
    trainer = ContextParallelTrainer(  # cpvlm (was: Trainer()
        model=model,
        args=training_args,
        train_dataset=synthetic_samples(model.config, args.samples, dtype),
        eval_dataset=eval_samples(model.config, dtype) if args.eval else None,
        data_collator=lambda features: collate(features, pad_id),
        cp_size=args.cp,  # cpvlm
        ep=args.ep,  # cpvlm
        tp=args.tp,  # cpvlm
        pack=args.pack,
    )
    trainer.train(resume_from_checkpoint=args.resume or None)
    if args.eval:
        trainer.evaluate()  # eval_loss: the answers' token mean, in trainer_state.json
    trainer.save_state()  # trainer_state.json
    trainer.save_model()
    trainer.accelerator.end_training()  # before exit: destroys the process group


if __name__ == "__main__":
    main()
