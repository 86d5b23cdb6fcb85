"""Reading a config never imports vLLM or torch (12 s and hundreds of MB on a loaded 2-core node): not the
app builder, not a gateway replica re-reading the whole config, not a model replica validating its model
as the builder handed it over (every field explicit, `extra_engine_args` and `quantization` included).
The names those checks need come from vLLM's source (`shunter.vllm_compat`). Run in a fresh interpreter:
this one may have imported vLLM already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from shunter.config import ModelConfig

_PROBE = """
import json, sys, yaml
from shunter.config import ModelConfig, parse_config
args = yaml.safe_load(open("configs/local.yaml"))["applications"][0]["args"]
args["models"][0]["engine"]["extra_engine_args"] = {"enable_chunked_prefill": True}
args["models"][0]["engine"]["quantization"] = "fp8"
cfg = parse_config(args)
type(cfg).model_validate(cfg.model_dump(mode="json"))  # what each gateway replica does
for model in cfg.models:  # what each model replica does, with the dict the app builder binds
    for version in model.version_names():
        ModelConfig.model_validate(model.for_version(version).model_dump(mode="json", exclude={"pricing"}))
print(json.dumps({name: name in sys.modules for name in ("vllm", "torch")}))
"""


def test_no_step_of_reading_a_config_imports_vllm_or_torch():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"vllm": False, "torch": False}


def test_an_unknown_engine_argument_or_quantization_is_still_refused_by_name():
    base = {"name": "m", "source": "builtin:smollm2-135m-instruct"}
    with pytest.raises(ValidationError, match="'enable_chunky_prefill' is not a vLLM engine argument; did you "
                                              "mean 'enable_chunked_prefill'"):
        ModelConfig.model_validate({**base, "engine": {"extra_engine_args": {"enable_chunky_prefill": True}}})
    with pytest.raises(ValidationError, match="unknown quantization 'fp9'"):
        ModelConfig.model_validate({**base, "engine": {"quantization": "fp9"}})
