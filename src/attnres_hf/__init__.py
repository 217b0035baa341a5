"""attnres-hf: Attention Residuals (Kimi Team, arXiv:2603.15031) for Hugging Face `transformers`.

Importing the package registers `AttnResConfig` (`model_type="attnres"`), `AttnResModel` and `AttnResForCausalLM`
with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`, and marks them for `auto_map` so that a saved folder
also loads with `trust_remote_code=True` where this package is not installed. Registration is idempotent. The
`kimi_k3` backbone's own classes are not registered: the released K3 folder's `model_type` is `kimi_k3` too, and a
registered class would take precedence over its remote code; `attnres convert` reads the family's folders through
its adapter (`retrofit.load_source_config`).
"""

from importlib.metadata import PackageNotFoundError, version

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import modeling
from .modeling import *  # noqa: F403  (the public API is the model's)
from .modeling import AttnResConfig, AttnResForCausalLM, AttnResModel

try:
    __version__ = version("attnres-hf")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
AttnResConfig.register_for_auto_class("AutoConfig")
AttnResModel.register_for_auto_class("AutoModel")
AttnResForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = list(modeling.__all__)
