"""DeepSeek-V4 forward over paged pools (torch + transformers; never the tree)."""

from shadowradix.model.context import CompressorState, PagedStorage, RequestKV
from shadowradix.model.runner import DeepseekV4Runner

__all__ = ["CompressorState", "DeepseekV4Runner", "PagedStorage", "RequestKV"]
