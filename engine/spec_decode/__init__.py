"""Speculative decoding by prompt lookup: n-gram drafts, verified in the paged engine.

config.py    SpeculativeConfig: vLLM's `speculative_config` dict, checked once
ngram.py     NgramProposer: drafts from the sequence's own prompt and output
verifier.py  DraftVerifier: every drafted token of a step checked in one pass
             (greedy: the target's argmax; sampled: rejection sampling)
"""
