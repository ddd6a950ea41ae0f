"""``cpvlm train --lora-r 4`` (PEFT LoRA on the frozen model) under CP, resume and export.

Three runs of the tiny Qwen3-VL in float64, 3 steps on the synthetic image/video/text data:
cp 1 (checkpoints at steps 2 and 3), cp 2 with DDP, and the cp 1 run resumed from its step 2 at
cp 2 with FSDP2 (the default). Their losses and exported adapters agree to 1e-10 relative (the
CP runs add the same terms in another order; observed ~1e-15). The checkpoints hold only the
LoRA matrices (the base is frozen and rebuilt); the trained B matrices moved off zero; the
exported adapter (``PeftModel.from_pretrained`` on the base) and the ``--merge-lora`` model
(``from_pretrained``) give the same logits (float64, 1e-10), which differ from the base's.
"""

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from cpvlm.export import main as export_main
from cpvlm.hf import build_model
from cpvlm.train.command import main as train_main
from cpvlm.train.config import LoRAConfig
from cpvlm.train.lora import DEFAULT_TARGETS, apply_lora

pytest.importorskip("peft")
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

TOL = 1e-10
FLAGS = ("--steps", "3", "--seq-len", "192", "--dtype", "float64", "--lora-r", "4")


def _train(out, *flags):
    assert train_main(["--out", str(out), *FLAGS, *flags]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _export(run, out, *flags):
    assert export_main(["--run", str(run), "--out", str(out), *flags]) == 0
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _adapter(path):
    return load_file(str(path / "adapter_model.safetensors"))


def test_lora_at_cp2_ddp_and_resumed_fsdp_equals_cp1_and_exports(tmp_path):
    one = _train(tmp_path / "cp1", "--cp", "1", "--loss-chunk", "0", "--ckpt-every", "2")
    two = _train(tmp_path / "cp2", "--cp", "2", "--data-parallel", "ddp")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "cp1", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    again = _train(resumed, "--cp", "2", "--resume")  # FSDP2 over the frozen base, from step 2
    assert [r["ranks"] for r in again] == [1, 1, 2]  # steps 1-2 of cp 1, step 3 trained at cp 2
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two] == [r["tokens"] for r in again]
    for a, b, c in zip(one, two, again, strict=True):
        assert abs(b["loss"] - a["loss"]) <= TOL * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(c["loss"] - a["loss"]) <= TOL * abs(a["loss"]), (a["step"], a["loss"], c["loss"])
    assert one[-1]["grad_norm"] > 0 and one[-1]["loss"] != one[0]["loss"]  # it trained

    # Only LoRA matrices are checkpointed and optimized: 2 per adapted layer (A and B).
    meta = FileSystemReader(str(tmp_path / "cp1" / "checkpoints" / "step_00000003"))
    keys = list(meta.read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
    assert optim_keys and all(".lora_A." in k or ".lora_B." in k for k in optim_keys), optim_keys

    ref = _adapter(_export(tmp_path / "cp1", tmp_path / "a1"))
    assert set(ref) == set(_adapter(_export(tmp_path / "cp2", tmp_path / "a2")))
    for other in (_adapter(tmp_path / "a2"), _adapter(_export(resumed, tmp_path / "a3"))):
        for k, v in ref.items():
            assert _rel(other[k], v) <= TOL, k
    b_keys = [k for k in ref if "lora_B" in k]
    assert len(b_keys) == len(model_keys) // 2 and all(ref[k].abs().max() > 0 for k in b_keys)
    assert all(v.dtype == torch.float64 for v in ref.values())

    # The adapter on the base and the merged model compute the same logits, not the base's.
    merged = _export(tmp_path / "cp1", tmp_path / "merged", "--merge-lora")
    base = build_model("qwen3-vl-tiny", dtype=torch.float64, seed=0)
    ids = torch.randint(5, base.config.text_config.vocab_size - 1, (1, 24))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft = PeftModel.from_pretrained(base, str(tmp_path / "a1")).eval()
        peft_logits = peft(input_ids=ids).logits
        model = AutoModelForImageTextToText.from_pretrained(str(merged), dtype=torch.float64)
        merged_logits = model.eval()(input_ids=ids).logits
    assert _rel(merged_logits, peft_logits) <= TOL
    assert _rel(peft_logits, base_logits) > 1e-6


def test_lora_trains_only_the_adapters_of_the_targets():
    model = apply_lora(build_model("qwen3-vl-tiny", dtype=torch.float64, seed=0), LoRAConfig(4), 0)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert all("language_model" in n for n in trained)  # the tower stays frozen by default
    layers = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}
    assert layers == set(DEFAULT_TARGETS)
    vision = apply_lora(
        build_model("qwen3-vl-tiny", dtype=torch.float64, seed=0),
        LoRAConfig(4, targets=("self_attn.*",), vision=True),
        0,
    )
    names = [n for n, p in vision.named_parameters() if p.requires_grad]
    assert any(".visual." in n for n in names)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if "language_model" in n} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-alpha", "8"], "add --lora-r"),
        (["--lora-vision"], "add --lora-r"),
        (["--lora-r", "0"], "--lora-r 1 or more"),
        (["--lora-r", "4", "--freeze-vision"], "frozen already"),
        (["--lora-r", "4", "--lora-alpha", "-1"], "finite number > 0"),
    ],
)
def test_lora_flag_errors(flags, message, capsys, no_training_process):
    assert train_main(["--steps", "1", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_lora_target_matching_nothing_names_the_layers():
    model = build_model("qwen3-vl-tiny", dtype=torch.float64, seed=0)
    with pytest.raises(ValueError, match="match no linear layer.*q_proj"):
        apply_lora(model, LoRAConfig(4, targets=("qkv_proj",)), 0)
