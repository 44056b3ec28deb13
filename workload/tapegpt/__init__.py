"""A small GPT with tape autograd, written once for NumPy and CuPy: the training workload that xpool is measured on."""
from .checkpoint import export_weights, load_checkpoint, load_weights, save_checkpoint
from .data import get_batch, load_corpus
from .model import GPT, GPTConfig, init_params, param_shapes
from .optim import AdamW
from .serve import Server
from .tape import Tensor

__all__ = [
    "GPT", "GPTConfig", "AdamW", "Server", "Tensor", "load_corpus", "get_batch",
    "save_checkpoint", "load_checkpoint", "export_weights", "load_weights", "init_params", "param_shapes",
]
