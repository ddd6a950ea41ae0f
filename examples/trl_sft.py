"""A TRL SFTTrainer script (conversations with images, TRL's collator and the model's processor)
trained under cpvlm's context parallelism, packing included.

    torchrun --nproc-per-node 2 examples/trl_sft.py --cp 2 --output-dir out --packing   # CPU
    torchrun --nproc-per-node 8 examples/trl_sft.py --cp 4 --model /path/to/checkpoint ...

Without --model, a tiny Qwen3-VL checkpoint with a real processor is written into
<output-dir>/tiny-checkpoint first. The lines marked ``# cpvlm`` are all that CP changes. The
global batch of a step is batch-size x grad-accum x dp conversations; with --packing each batch
is one packed row with per-document masks. Writes trainer_state.json and the trained model (or
the LoRA adapter) into --output-dir.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from datasets import Dataset
from PIL import Image
from transformers import AutoProcessor, set_seed
from trl import SFTConfig, SFTTrainer  # noqa: F401  (the script's usual imports)

from cpvlm.hf import build_model
from cpvlm.hf.trl import ContextParallelSFTTrainer  # cpvlm

WORDS = "a red square on a blue field two cats a ball that rolls to the left and stops"


def conversations(count: int) -> Dataset:
    """``count`` conversations of different lengths, two of every three about an image."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        answer = " ".join(WORDS.split()[: 3 + (5 * i) % 11])
        size = ((32, 32), (64, 32), None)[i % 3]
        images = (
            [] if size is None else [Image.fromarray(rng.integers(0, 256, (*size, 3), np.uint8))]
        )
        rows.append(
            {
                "images": images,
                "messages": [
                    {"role": "user", "content": "What is in the picture?" if images else "Count."},
                    {"role": "assistant", "content": answer},
                ],
            }
        )
    return Dataset.from_list(rows)


def load_processor(path, model_config):
    try:
        return AutoProcessor.from_pretrained(path)
    except ImportError:  # no torchvision for the video processor; cpvlm's needs none for images
        from cpvlm.hf.data.processor import ChatEncoder

        return ChatEncoder(path, model_config).processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint dir (default: a tiny one)")
    parser.add_argument("--cp", type=int, default=2, help="ranks per sequence; dp = world / cp")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="per DP replica")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--lora-r", type=int, default=0, help="train a LoRA adapter of this rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--packing", action="store_true", help="pack each batch into one row")
    args = parser.parse_args()

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        packing=args.packing,
        max_length=None,
        gradient_checkpointing=False,
        bf16=args.dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),  # gloo on CPU
    )
    path = args.model
    if path is None:
        from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint

        path = Path(args.output_dir) / "tiny-checkpoint"
        with PartialState().main_process_first():
            if not (path / "config.json").exists():
                make_tiny_checkpoint(path, "qwen3_vl")
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets)
    set_seed(config.seed)  # the adapter's random init, the same in every run
    model = build_model(path, dtype=getattr(torch, args.dtype))
    processor = load_processor(path, model.config)
    trainer = ContextParallelSFTTrainer(  # cpvlm (was: SFTTrainer()
        model=model,
        args=config,
        train_dataset=conversations(args.samples),
        processing_class=processor,
        peft_config=peft_config,
        cp_size=args.cp,  # cpvlm
    )
    trainer.train()
    trainer.save_state()  # trainer_state.json
    if not hasattr(getattr(processor, "video_processor", processor), "save_pretrained"):
        trainer.processing_class = processor.tokenizer  # cpvlm's stand-in cannot be saved
    trainer.save_model()
    trainer.accelerator.end_training()  # before exit: destroys the process group


if __name__ == "__main__":
    main()
