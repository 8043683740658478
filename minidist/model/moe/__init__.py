"""Mixture of experts on one device (chapter 06): routers, balancing losses, capacity, sorted dispatch.

The modules: `routing` (routers and balancing losses), `dispatch` (capacity, the sorted dispatch and the experts
that run it), `layer` (`MoELayer`, and the boolean-mask reference it is checked against), `stats` (what the trainer
calls after a step: the logged balance figures and the router-bias update).

A token goes to k of N expert MLPs chosen by a learned router, so the parameter count grows with N while the
compute per token grows only with k (Shazeer et al. 2017, "Outrageously Large Neural Networks").

Routers (`route`):
- "softmax": p = softmax(x W_r); the k largest p are chosen. top-1 keeps the gate p_i (Switch, Fedus et al. 2021);
  top-k > 1 renormalizes the chosen p to sum to 1 (Mixtral, Jiang et al. 2024: softmax over the top-k logits).
- "sigmoid": s = σ(x W_r); experts are chosen by s + b, where b is the auxiliary-loss-free bias, but the gates use
  s alone, renormalized over the chosen k and multiplied by routed_scaling_factor (DeepSeek-V3 2024, eq. 12-16).
Ties are broken deterministically: the lower expert index wins (a stable descending sort).

Balancing: `load_balancing_loss` (Switch, eq. 4-6, computed per sequence as DeepSeek-V3's sequence-wise loss,
eq. 17-20), `router_z_loss` (ST-MoE, Zoph et al. 2022, eq. 5) and the auxiliary-loss-free bias (Wang et al. 2024;
DeepSeek-V3 §2.1.2), updated by `update_router_biases`.

Capacity: each expert takes at most C = ⌈capacity_factor · T · k / N⌉ token-slots of each *sequence* of T tokens.
Priority inside a sequence is (choice rank, position): every first choice is served before any second choice, and
within one rank the earlier position wins — GShard's rule (Lepikhin et al. 2020, Algorithm 1), applied per sequence.
A dropped slot contributes zero; the residual connection carries the token. capacity_factor None: dropless.

Why per sequence (not per forward call, or per device as in GShard and Switch): parity. No layout but context
parallelism splits a sequence, so the dropped slots and the balance loss f·P (not linear in the tokens) are the
same in every layout; cp ranks would exchange small counts (see `plan_dispatch`, `sequence_balance_losses`).

Dispatch: slots are sorted by expert id (a stable argsort), gathered with index_select into one buffer where each
expert's tokens are a contiguous slice, run through the experts (a loop over experts, or torch._grouped_mm), and
summed back with index_add. `layer.moe_forward_naive` is the boolean-mask loop it is checked against.

Trainer contract:
- `Transformer.aux_loss()` sums `MoELayer.aux_loss` (α·balance + z_coef·z, weighted) of the last forward; add it
  to the LM loss per micro-batch. Both are means (over sequences, over tokens): equal micro-batches and replicas
  average to the global batch's value.
- `moe_stats(model, reduce_fn)` after a step: balance figures of the training forwards since the previous call,
  from sums that `reduce_fn` adds over ranks, so every layout logs the figures of the whole global batch.
- `update_router_biases(model, reduce_fn)` after each optimizer step: b_i += γ·sign(mean_load − load_i) from the
  routed-slot counts of every training forward since the previous call, then resets them. Under data parallelism
  reduce_fn sums the counts over the replicas, so every replica applies the same update.
"""
