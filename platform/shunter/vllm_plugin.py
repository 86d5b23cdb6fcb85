"""Shunter's vLLM general plugin (entry point `vllm.general_plugins`: `shunter = shunter.vllm_plugin:register`).

vLLM loads every general plugin in each of its processes (the engine core, every worker) before the model
runs, the one documented way to reach them. Shunter's only use: on the CPU platform, the LoRA fix of
`shunter.vllm_compat.fix_cpu_lora_base_rows` (a base-model request batched with an adapter's request got the
adapter applied). Plugins may be loaded more than once per process; the fix applies once.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from shunter.vllm_compat import fix_cpu_lora_base_rows

        if fix_cpu_lora_base_rows():
            log.info("shunter: vLLM's CPU LoRA ops leave base-model tokens alone (shunter.vllm_compat)")
    except Exception:  # noqa: BLE001 - a plugin must never stop vLLM from starting; the e2e tests catch the loss
        log.exception("shunter: the CPU LoRA fix could not be applied")
