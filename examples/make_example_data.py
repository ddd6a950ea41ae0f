"""Make a small training set of conversations with images and a video, and a local checkpoint.

    python examples/make_example_data.py runs/example [--model internvl-tiny]
    cpvlm train --model runs/example/ckpt --data runs/example/data/train.jsonl --cp 2 --steps 20

``runs/example/data/`` gets PNG images of several sizes, frame folders for videos, WAV clips
where the model takes audio (``--model qwen3-omni-moe-tiny`` or ``gemma4-audio-tiny``: tones
under noise), and ``train.jsonl``: one conversation a line, in the messages format transformers
processors take, with paths relative to the file:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/s1_0.png"},
                                               {"type": "text", "text": "Describe the image."}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "two cats"}]}]}

``runs/example/ckpt/`` stands in for a downloaded checkpoint directory of the family of
``--model`` (default Qwen3-VL): a tiny model with random weights, its tokenizer, chat template,
image and video processor configs (what ``save_pretrained`` writes). The data has videos where
the family's processor takes them (not Gemma 3). With a real checkpoint, pass
its directory to ``cpvlm train --model`` instead.
"""

import argparse
from pathlib import Path

from cpvlm.hf.registry import default_model, tiny_adapters
from cpvlm.hf.tiny_checkpoint import (
    example_records,
    make_tiny_checkpoint,
    takes_example_audio,
    takes_example_videos,
    write_jsonl,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/example", help="folder to write")
    parser.add_argument("--samples", type=int, default=60, help="conversations to write")
    with_processor = [n for n, a in tiny_adapters().items() if a.kit.tiny_processor is not None]
    parser.add_argument(
        "--model", default=default_model(), choices=with_processor, help="tiny model family"
    )
    args = parser.parse_args()
    out = Path(args.out)
    family = tiny_adapters()[args.model].family
    ckpt = make_tiny_checkpoint(out / "ckpt", family, model=args.model)
    records = example_records(
        out / "data",
        args.samples,
        videos=takes_example_videos(family),
        audio=takes_example_audio(family, args.model),
    )
    jsonl = write_jsonl(out / "data" / "train.jsonl", records)
    print(f"checkpoint: {ckpt}\ndata:       {jsonl}")
    print(f"train:      cpvlm train --model {ckpt} --data {jsonl} --cp 2 --steps 20")


if __name__ == "__main__":
    main()
