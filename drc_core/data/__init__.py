"""Data: sources (via ``datasets``), document-level split, byte-level BPE, token memmaps, window sampler."""

from drc_core.data.prepare import DEFAULT_OUT, PrepareConfig, PrepareResult, prepare, split_documents
from drc_core.data.sampler import Corpus, WindowSampler, eval_windows
from drc_core.data.sources import DEFAULT_SOURCE, KNOWN_SOURCES, SourceSpec, load_documents
from drc_core.data.tokenizer import EOT, load_tokenizer, train_bpe

__all__ = ["DEFAULT_OUT", "DEFAULT_SOURCE", "EOT", "KNOWN_SOURCES", "Corpus", "PrepareConfig", "PrepareResult",
           "SourceSpec", "WindowSampler", "eval_windows", "load_documents", "load_tokenizer", "prepare",
           "split_documents", "train_bpe"]
