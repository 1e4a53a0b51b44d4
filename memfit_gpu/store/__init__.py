"""Episode store: the append-only log of episodes and summaries, and the indexes over them."""

from memfit_gpu.store.episodes import EpisodeStore, Summary, SummaryTable, episode_body, episode_text
from memfit_gpu.store.log import RecordLog, StoreCorruptError

__all__ = ["EpisodeStore", "RecordLog", "StoreCorruptError", "Summary", "SummaryTable", "episode_body", "episode_text"]
