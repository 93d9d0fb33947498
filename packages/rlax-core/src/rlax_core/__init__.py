"""rlax_core: what every RLAX node shares, without JAX.

The run config (`RunConfig`, `load_config`), tokenizers and chat templates
(`Tokenizer`, `CharTokenizer`, `ChatTemplate`), GGUF metadata (`GGUFFile`), crash-safe
file writes, and the `rlax`
front door (`rlax_core.cli`), which runs whichever component is installed on the node.
"""

from rlax_core.chat_template import ChatTemplate, ChatTemplateError
from rlax_core.config import (
    EXIT_CONFIG_ERROR,
    ConfigError,
    RunConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_config,
)
from rlax_core.gguf_file import GGUFError, GGUFFile, find_smollm2_gguf
from rlax_core.tokenizer import CharTokenizer, Tokenizer, TokenizerError, TokenizerLike

__all__ = [
    "EXIT_CONFIG_ERROR",
    "CharTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "ConfigError",
    "GGUFError",
    "GGUFFile",
    "RunConfig",
    "Tokenizer",
    "TokenizerError",
    "TokenizerLike",
    "apply_overrides",
    "dump_config",
    "find_smollm2_gguf",
    "load_config",
    "parse_config",
]
