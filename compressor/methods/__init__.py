"""Compression methods, registered once: the CLI, the API, `plan` and the benchmarks find them here.

To add a method: write one file with a `Method` subclass (see `base.py`; `lowrank.py` is the shortest
example) and add one `register(...)` line below.
"""

from compressor.methods.base import REGISTRY, Method, MethodContext, ModelShape, get_method, register
from compressor.methods.basis_sharing import BasisSharing
from compressor.methods.flap import Flap
from compressor.methods.lowrank import PlainSvd, SvdLlm
from compressor.methods.masa.method import Masa, MasaPaper
from compressor.methods.modegpt import ModeGpt
from compressor.methods.shared_mean import SharedMean

register(Masa())
register(MasaPaper())
register(SvdLlm())
register(PlainSvd())
register(SharedMean())
register(BasisSharing())
register(Flap())
register(ModeGpt())

__all__ = ["REGISTRY", "Method", "MethodContext", "ModelShape", "get_method", "register"]
