"""The tool-call formats of the model families RLAX trains: one module per family, the
protocol in `base`, and the bounded JSON reading they share in `json_text`.
`rlax_data.envs.formats` chooses among them by name or by chat template."""

from rlax_data.envs.tool_formats.base import MalformedCall, ParsedCall, ToolCallError, ToolFormat
from rlax_data.envs.tool_formats.bracket import BracketToolFormat
from rlax_data.envs.tool_formats.hermes import HermesToolFormat
from rlax_data.envs.tool_formats.llama import Llama3JsonToolFormat
from rlax_data.envs.tool_formats.mistral import MistralToolFormat

__all__ = [
    "BracketToolFormat",
    "HermesToolFormat",
    "Llama3JsonToolFormat",
    "MalformedCall",
    "MistralToolFormat",
    "ParsedCall",
    "ToolCallError",
    "ToolFormat",
]
