"""NextN (MTP) speculative decoding, EAGLE-2 style: draft a token tree with the MTP layer, verify it in one
target forward, accept the longest path the target agrees with (docs/speculative.md).

Modules, one job each: `draft_runner` (the MTP layer's forwards and CUDA graphs on the model runner),
`tree_table` (per-row KV index lists: tree attention as a batched decode), `tree_forward` (a tree batch
through the model or the draft), `draft` (the EAGLE-2 draft tree), `accept` (greedy and tree speculative
sampling), `decoder` (the scheduler's spec step: draft, verify, accept), `step_batch` (the step's device
inputs in one copy, index tensors per batch size), `commit` (commit KV, hand tokens to the output
processor), `draft_model` (a separate NextN checkpoint and the start-up checks), `stats` (accepted-length
counters).
"""
