"""Hugging Face transformers models on epmoe (`pip install 'epmoe[hf]'`; the only part of epmoe that imports
transformers).

Importing this package registers "epmoe" in transformers' experts registries (`ExpertsInterface`, and the
FP8 experts' one), and, where transformers has it (5.24+), in `EPImplementationInterface`:

    import epmoe.hf
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="epmoe")   # one device
    model = epmoe.hf.from_pretrained(path, group, options=epmoe.hf.EPOptions(dispatcher="ht",
                                     decode_dispatcher="ll"))                           # expert-parallel
    out = epmoe.hf.generate(model, input_ids, max_new_tokens=32)                        # on every rank
    AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(
        ep_size=N, ep_implementation="epmoe"))                                          # transformers' EP

- `experts_forward`: the experts backend; `experts.unsupported` says what it refuses and why.
- `expert_parallel`, `from_pretrained`, `generate`, `EPOptions`: expert parallelism with data-parallel
  attention, loading only this rank's experts.
- `config_from_hf`, `expert_weights`, `Checkpoint`, `read_experts`: configs and checkpoint tensors for
  epmoe's own FusedMoE.
"""
from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
from transformers.integrations.moe import ExpertsInterface

from .backend import experts_forward
from .checkpoint import Checkpoint, config_from_hf, expert_weights, read_experts
from .loading import from_pretrained
from .parallel import EPOptions, expert_parallel, generate

try:
    from transformers.distributed.expert_parallel import EPImplementationInterface
except ImportError:  # transformers before 5.24 has no EP implementations registry
    EPImplementationInterface = None

ExpertsInterface.register("epmoe", experts_forward)
FP8ExpertsInterface.register("epmoe", experts_forward)
if EPImplementationInterface is not None:
    from .ep_interface import EpmoeEP
    EPImplementationInterface.register("epmoe", EpmoeEP)

__all__ = ["Checkpoint", "EPOptions", "config_from_hf", "expert_parallel", "expert_weights", "experts_forward",
           "from_pretrained", "generate", "read_experts"]
