"""Episode store: the append-only log of episodes and summaries, and the indexes over them."""

from memfit_gpu.store.episodes import EpisodeStore
from memfit_gpu.store.log import RecordLog, StoreCorruptError
from memfit_gpu.store.summary_table import Summary, SummaryTable
from memfit_gpu.store.text import episode_body, episode_prefix, episode_text

__all__ = ["EpisodeStore", "RecordLog", "StoreCorruptError", "Summary", "SummaryTable", "episode_body", "episode_prefix", "episode_text"]
