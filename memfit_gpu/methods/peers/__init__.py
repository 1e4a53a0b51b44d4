"""The systems researchers compare MemFit with, run from their own packages (the `peers` extra).

endpoint.py  an OpenAI-compatible endpoint on 127.0.0.1 over the run's reader and encoder, so every call
             a peer makes is cached and counted in the run's ledger like MemFit's own
mem0.py      method=mem0: mem0's `Memory`, fed and searched as mem0's own LoCoMo evaluation does
"""
