"""Curation: dedup, contamination, length limits, pass-rate pre-filtering, curriculum buckets."""

from rlax_data.curation.contamination import ContaminationConfig, ContaminationReport, find_contamination
from rlax_data.curation.curriculum import bucket_sources, difficulty_buckets
from rlax_data.curation.dedup import DedupConfig, DedupReport, deduplicate
from rlax_data.curation.length import LengthReport, Tokenize, filter_by_length
from rlax_data.curation.prefilter import PassRateConfig, PrefilterReport, prefilter_by_pass_rate
from rlax_data.curation.report import render_summary
from rlax_data.curation.text import normalize_text, record_text

__all__ = [
    "ContaminationConfig",
    "ContaminationReport",
    "DedupConfig",
    "DedupReport",
    "LengthReport",
    "PassRateConfig",
    "PrefilterReport",
    "Tokenize",
    "bucket_sources",
    "deduplicate",
    "difficulty_buckets",
    "filter_by_length",
    "find_contamination",
    "normalize_text",
    "prefilter_by_pass_rate",
    "record_text",
    "render_summary",
]
