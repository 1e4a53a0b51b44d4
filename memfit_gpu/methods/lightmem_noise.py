"""Error injection for LightMem-SLM (the paper's Table 6 "error injection under a fixed top-K
budget" and Table 7's "MTM noise saturation"), switched by `lightmem.noise.*` (all 0 by default).

How noise is made (the paper gives the rates, not the recipe; these are this implementation's choices):

- Which items: of the n items a switch covers, exactly round(fraction x n) are replaced: those with the
  smallest sha256(f"{noise.seed}:{switch}:{item key}"). The choice depends on the seed and on each item's
  own key (a question id and HQ number, a user and MTM entry number), not on batch order, so a resumed or
  re-sliced run noises the same items. fraction 0 replaces nothing: the run is bit for bit the run without
  noise (nothing is drawn, recorded or changed).
- What replaces an item: an item of the same kind chosen by sha256 among the donors, which are the items
  of the other users (memories) of the run, and when the run has a single user, that user's items that are
  unrelated to this one (another question's HQs; the notes of another session). A replacement is always the
  donor's original text, never another replacement; an item without any donor stays as it is (counted).
- `noise.hq` (SLM-1, "50 % HQ noise"): over every HQ of every question after SLM-1's reply is parsed and
  routed: the HQ's text becomes an HQ written for another question; its tier and budget stay (routing and
  the top-K budget are SLM-1's and the method's, the content is wrong). The pack row marks it
  (`lightmem.hqs[i].noise_from` = the donor question id).
- `noise.write` (SLM-3, "50 % write noise"): over the MTM notes of one write batch (every window due, all
  users: the whole benchmark on a first run): a note is stored with the text of a donor note of the same
  batch. The log record keeps SLM-3's own text (`slm_text`) and the donor (`noise`); consolidation reads the
  stored notes, so the noise reaches LTM as a faulty SLM-3's would.
- `noise.mtm` (MTM noise saturation): over every MTM note of every user when the read stage starts: the
  searchable MTM (and what the reader is shown of it) holds the donor's text; the log and LTM keep the clean
  notes, so LTM holds consolidated knowledge that the noisy MTM lacks (the update-gap stress test).

A replaced note no longer stands for its own window's turns: retrieval diagnostics count no store row for
it (nor for the LTM nodes only it supports).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memfit_gpu.data.schema import Question

SWITCHES = ("hq", "write", "mtm")


def _rank(seed: int, switch: str, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{switch}:{key}".encode()).digest()[:8], "big")


def chosen(keys: Sequence[str], fraction: float, seed: int, switch: str) -> set[int]:
    """Positions of the round(fraction x len(keys)) items with the smallest hash (module doc)."""
    count = round(fraction * len(keys))
    if count <= 0:
        return set()
    order = sorted(range(len(keys)), key=lambda i: (_rank(seed, switch, keys[i]), i))
    return set(order[:count])


@dataclass(frozen=True)
class Item:
    key: str  # unique within its switch: what decides whether it is replaced
    owner: str  # the user (memory id) it belongs to
    group: str  # what makes two items of one user related (the question; the session)
    text: str


def replacements(items: Sequence[Item], fraction: float, seed: int, switch: str) -> dict[int, int]:
    """{position of a replaced item: position of its donor}. Donors: another user's items, else (one user)
    the same user's items of another group; an item with no donor is left out."""
    if switch not in SWITCHES:
        raise ValueError(f"unknown noise switch {switch!r}; one of {', '.join(SWITCHES)}")
    picked = chosen([item.key for item in items], fraction, seed, switch)
    if not picked:
        return {}
    several_users = len({item.owner for item in items}) > 1
    donors_of: dict[str, list[int]] = {}  # owner (several users) or group (one user) -> donor positions
    out: dict[int, int] = {}
    for i in sorted(picked):
        item = items[i]
        side = item.owner if several_users else item.group
        if side not in donors_of:
            donors_of[side] = [j for j, other in enumerate(items)
                               if (other.owner if several_users else other.group) != side]
        donors = donors_of[side]
        if donors:
            out[i] = donors[_rank(seed, f"{switch}-donor", item.key) % len(donors)]
    return out


# ------------------------------------------------------------------------------ LightMem's hooks
def noise_hqs(plans: list[list[Any]], questions: Sequence[Question], fraction: float, seed: int) -> list[list[Any]]:
    """`noise.hq`: the plans (per question, its routed HQs) with the chosen HQs' text replaced (module doc);
    fraction 0 returns `plans` itself."""
    if not fraction:
        return plans
    flat = [(qi, hi) for qi, plan in enumerate(plans) for hi in range(len(plan))]
    items = [Item(f"{questions[qi].question_id}:{hi}", questions[qi].memory_id, questions[qi].question_id,
                  plans[qi][hi].text) for qi, hi in flat]
    out = [list(plan) for plan in plans]
    for i, j in replacements(items, fraction, seed, "hq").items():
        qi, hi = flat[i]
        out[qi][hi] = dataclasses.replace(out[qi][hi], text=items[j].text, noise_from=items[j].group)
    return out


def _note_items(records: Sequence[dict[str, Any]]) -> list[Item]:
    return [Item(f"{r['user']}:{r['entry']}", str(r["user"]), str(r["session"]), str(r["text"])) for r in records]


def noise_notes(records: list[dict[str, Any]], fraction: float, seed: int, switch: str) -> dict[int, int]:
    """`noise.write`: MTM records (one write batch) with the chosen ones' text replaced in place by their
    donors' (SLM-3's own text kept as `slm_text`, the donor as `noise`); returns {replaced: donor}."""
    if not fraction:
        return {}
    items = _note_items(records)
    chosen_donors = replacements(items, fraction, seed, switch)
    for i, j in chosen_donors.items():
        records[i] = {**records[i], "text": items[j].text, "slm_text": items[i].text,
                      "noise": {"switch": switch, "from": [items[j].owner, int(records[j]["entry"])]}}
    return chosen_donors


def read_noise(records: Sequence[dict[str, Any]], fraction: float, seed: int) -> dict[tuple[str, int], str]:
    """`noise.mtm`: {(user, entry): the text the searchable MTM holds instead} over every MTM record."""
    if not fraction:
        return {}
    items = _note_items(records)
    return {(items[i].owner, int(records[i]["entry"])): items[j].text
            for i, j in replacements(items, fraction, seed, "mtm").items()}


def noisy_entries(memory: Any, switch: str = "write") -> set[int]:
    """The MTM entries of one user (UserMemory) stored with noise by `switch`."""
    return {e for e, r in memory.mtm.items() if (r.get("noise") or {}).get("switch") == switch}
