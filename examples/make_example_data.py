"""Make a small training set of conversations with images and a video, and a local checkpoint.

    python examples/make_example_data.py runs/example
    cpvlm train --model runs/example/ckpt --data runs/example/data/train.jsonl --cp 2 --steps 20

``runs/example/data/`` gets PNG images of several sizes, frame folders for videos, and
``train.jsonl``: one conversation a line, in the messages format transformers processors take,
with paths relative to the file:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/s1_0.png"},
                                               {"type": "text", "text": "Describe the image."}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "two cats"}]}]}

``runs/example/ckpt/`` stands in for a downloaded Qwen3-VL checkpoint directory: a tiny model
with random weights, its tokenizer, chat template, image and video processor configs (what
``save_pretrained`` writes). With a real checkpoint, pass its directory to ``--model`` instead.
"""

import argparse
from pathlib import Path

from cpvlm.integrations.hf.tiny_checkpoint import example_records, make_tiny_checkpoint, write_jsonl


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/example", help="folder to write")
    parser.add_argument("--samples", type=int, default=60, help="conversations to write")
    args = parser.parse_args()
    out = Path(args.out)
    ckpt = make_tiny_checkpoint(out / "ckpt", "qwen3_vl")
    jsonl = write_jsonl(out / "data" / "train.jsonl", example_records(out / "data", args.samples))
    print(f"checkpoint: {ckpt}\ndata:       {jsonl}")
    print(f"train:      cpvlm train --model {ckpt} --data {jsonl} --cp 2 --steps 20")


if __name__ == "__main__":
    main()
