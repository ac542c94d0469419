"""epmoe: expert-parallel Mixture-of-Experts for PyTorch, in Python and Triton.

    cfg = epmoe.MoEConfig(num_experts=E, top_k=K, hidden_size=D, intermediate_size=F)
    moe = epmoe.FusedMoE(cfg, group=None)
    moe.load_experts(w13_END, w2_EDF)
    out_TD = moe(x_TD, logits_TE)
"""
from .config import MoEConfig
from .interfaces import Dispatcher, ExpertBatch, Experts, Layout, check_pairing
from .layer import FusedMoE, GatedMLP
from .registry import list_dispatchers, list_experts, make_dispatcher, make_experts
from .routing import route

__all__ = [
    "Dispatcher", "ExpertBatch", "Experts", "FusedMoE", "GatedMLP", "Layout", "MoEConfig", "check_pairing",
    "list_dispatchers", "list_experts", "make_dispatcher", "make_experts", "route",
]
__version__ = "0.1.0"
