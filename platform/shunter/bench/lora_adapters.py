"""LoRA adapters for the builtin SmolLM2, made locally with `peft` (no hub), for `shunter bench lora` and
the e2e tests: seeded random weights, their `lora_B` scaled up so that a greedy answer differs from the
base model's and from every other adapter's (at 4x, "What is the capital of France?" gets a different
string from each seed). Rank 8 on the attention projections; about 0.4 s and 1 MB each. `peft` comes with
the dev extra (`make install`)."""

from __future__ import annotations

from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapter(base_dir: str | Path, out_dir: str | Path, seed: int, rank: int = 8, scale: float = 4.0) -> str:
    """Write a PEFT LoRA adapter of the model at `base_dir` into `out_dir`; returns `out_dir`."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("making test LoRA adapters needs peft: pip install 'peft>=0.13' (or make install)") from None
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False,
                        lora_dropout=0.0)
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, weight in adapted.named_parameters():
            if "lora_B" in name:
                weight.mul_(scale)
    adapted.save_pretrained(str(out_dir))
    return str(out_dir)
