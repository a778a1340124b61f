"""Plant realistic bugs in the library one at a time and report which the test suite catches.

Each mutation replaces one exact snippet (which must occur once) in one file, runs the
tests (stopping at the first failure), and restores the file. A mutation the suite
survives is a hole in the tests. Run on demand (it takes a while), not in CI:

    bash scripts/mutation_check.sh                 # the curated set
    bash scripts/mutation_check.sh --only e4m3_max # one mutation
    bash scripts/mutation_check.sh --set fresh     # the set not used to write the tests
    bash scripts/mutation_check.sh --set audit40   # issue 40's work, audited the same way
    bash scripts/mutation_check.sh --related-first # the tests naming the mutated module
                                                   # first, the whole suite for survivors

``--related-first`` gives the same verdicts (a mutation caught by some tests fails the
suite) in a fraction of the time: most mutations fail a test of their own module. A run
past ``--timeout`` is reported TIMEOUT and counts against the score until rerun alone.

The score of each set is recorded in docs/design.md ("Tests follow the registry").
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import subprocess
import sys
import time

import attrs

ROOT = pathlib.Path(__file__).resolve().parents[1]


@attrs.frozen
class Mutation:
    name: str
    path: str
    old: str
    new: str
    why: str  # the bug it stands for


def _m(name, path, old, new, why):
    return Mutation(name, path, old, new, why)


# The bugs the mutation audit planted (issue 20) and their kin: wrong operands, dropped
# terms, swapped masks, wrong FP8 constants, stale caches and views.
CURATED = [
    _m("fp8_dgrad_drops_branch", "fusible/functional/linear.py",
       "            dx = dx + accumulate_into.reshape(dx.shape)  # dy may come flat\n",
       "            dx = dx\n",
       "FP8 BackwardLinearAdd forgets to accumulate the branch gradient"),
    _m("layer_norm_mask_swapped", "fusible/ops/layer_norm.py",
       "ctx.needs.input, *ctx.needs.params,", "ctx.needs.input, *reversed(ctx.needs.params),",
       "LayerNorm's weight and bias gradient masks swapped"),
    _m("e4m3_max", "fusible/quantization/casts/common.py",
       "FP8_MAX = {torch.float8_e4m3fn: 448.0,", "FP8_MAX = {torch.float8_e4m3fn: 240.0,",
       "E4M3's largest value wrong (240, the fnuz variant's)"),
    _m("dgrad_weight_e5m2", "fusible/functional/linear_state.py",
       "weight_format=recipe.weight_format(),",
       "weight_format=recipe.grad_format(),",
       "the weight quantized to E5M2 for the dgrad GEMM"),
    _m("dgrad_weight_kept_for_wgrad", "fusible/functional/linear.py",
       "del w_t  # freed before", "pass  # freed before",
       "the FP8 weight copy of dgrad kept alive through the wgrad GEMM (peak memory)"),
    _m("view_keeps_stale_transpose", "fusible/quantization/tensor/ops.py",
       "keep = t._transpose is not None and same_rows",
       "keep = t._transpose is not None",
       "a Float8Tensor view that changes the last dimension keeps its transposed copy"),
    _m("addmm_drops_bias", "fusible/quantization/tensor/ops.py",
       "        return scaled_mm(a, b, bias=bias)\n", "        return scaled_mm(a, b)\n",
       "addmm on two Float8Tensors drops the bias"),
    _m("swiglu_in_16_bits", "fusible/functional/activations.py",
       "    return _deinterleave(x.to(compute_dtype(x.dtype)), interleave).chunk(2, -1)",
       "    return _deinterleave(x, interleave).chunk(2, -1)",
       "the gated units' PyTorch path computes in bf16 instead of float32"),
    _m("plan_cache_ignores_extra_rg", "fusible/core/conditions.py",
       "                tuple([e.requires_grad for e in extra_inputs]), recipe_key, training,",
       "                _falses(len(extra_inputs)), recipe_key, training,",
       "the plan cache ignores whether extra inputs require grad"),
    _m("all_gather_backward_wrong_rank", "fusible/ops/all_gather.py",
       "        return BackwardResult(args.grad_output[mine])",
       "        return BackwardResult(args.grad_output[mine] if parallel.group_rank(args.group) "
       "== 0 else args.grad_output[:mine.stop - mine.start])",
       "AllGather's backward slices rank 0's rows on the other ranks"),
    _m("bias_grad_keepdim", "fusible/functional/linear.py",
       "    return tokens_2d(grad_output).sum(0)\n",
       "    return tokens_2d(grad_output).sum(0, keepdim=True)\n",
       "a bias gradient of shape (1, n): autograd would sum it silently"),
    _m("scale_inverted", "fusible/quantization/casts/common.py",
       "scale = (amax.new_full((), FP8_MAX[fp8_dtype]) / amax)",
       "scale = (amax / amax.new_full((), FP8_MAX[fp8_dtype]))",
       "the FP8 scale computed upside down"),
    _m("gelu_tanh_ignored", "fusible/functional/activations.py",
       '    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),',
       '    "gelu_tanh": (lambda x: F.gelu(x),',
       "GELU's tanh approximation ignored in the forward"),
    _m("relu_backward_reads_input_sign", "fusible/functional/activations.py",
       '"relu": (torch.relu, lambda dy, y: aten.threshold_backward(dy, y, 0), True)',
       '"relu": (torch.relu, lambda dy, y: aten.threshold_backward(dy, y, -1), True)',
       "ReLU's backward passes gradient where the output is zero"),
    _m("rms_norm_eps_outside", "fusible/functional/norms.py",
       "rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)",
       "rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True)) + eps",
       "RMSNorm adds eps after the square root"),
    _m("make_extra_output_drops_branch", "fusible/ops/make_extra_output.py",
       "        return BackwardResult(args.grad_output + args.grad_extra_output)",
       "        return BackwardResult(args.grad_output)",
       "MakeExtraOutput's backward drops the branch gradient"),
    _m("add_extra_input_no_grad", "fusible/ops/add_extra_input.py",
       "(dy if args.need_grad_extra_input else None,))",
       "(dy if args.need_grad_input else None,))",
       "AddExtraInput's extra-input gradient follows the wrong mask"),
    _m("constant_scale_backward_unscaled", "fusible/ops/constant_scale.py",
       "return BackwardResult(args.grad_output * args.scale if args.need_grad_input else None)",
       "return BackwardResult(args.grad_output if args.need_grad_input else None)",
       "ConstantScale's backward forgets the scale"),
    _m("bias_grad_follows_input_mask", "fusible/ops/bias.py",
       "(bias_grad(args.grad_output) if args.need_grad_bias else None,))",
       "(bias_grad(args.grad_output) if args.need_grad_input else None,))",
       "Bias computes its gradient when the input (not the bias) needs one"),
    _m("attribute_change_keeps_plan", "fusible/core/operation.py",
       '        if name != "training" and not parameter and epoch.changed(old, value):\n',
       '        if False and epoch.changed(old, value):\n',
       "changing an op's attribute keeps the stale plan"),
    _m("recipe_not_in_plan_key", "fusible/core/conditions.py",
       "        return (x.dtype, device_type, True, x.requires_grad,\n"
       "                None if params is None else tuple([p.requires_grad for p in params]),\n"
       "                tuple([e.requires_grad for e in extra_inputs]), recipe_key, training,",
       "        return (x.dtype, device_type, True, x.requires_grad,\n"
       "                None if params is None else tuple([p.requires_grad for p in params]),\n"
       "                tuple([e.requires_grad for e in extra_inputs]), None, training,",
       "the FP8 recipe left out of the plan cache key (with grad enabled)"),
    _m("recompute_ignores_forward_recipe", "fusible/runtime/recompute.py",
       "        if traced or torch._C._current_graph_task_id() == -1:",
       "        if True:",
       "activation checkpointing recomputes under the recipe at backward time"),
    _m("wgrad_wrong_scale", "fusible/functional/linear.py",
       "x_saved._transpose.t(), x_saved.transpose_scale_inv.t(), None,",
       "x_saved._transpose.t(), _times(dy_q.transpose_scale_inv, grad_scale).t(), None,",
       "the FP8 wgrad scaled by the wrong operand's scale"),
    _m("reshape_backward_keeps_shape", "fusible/ops/reshape.py",
       "        return BackwardResult(args.grad_output.reshape(args.input_shape))",
       "        return BackwardResult(args.grad_output.reshape(-1, args.input_shape[-1]))",
       "Reshape's backward returns a flattened gradient"),
    # the Triton kernels of issue 12 (checked on CPU under TRITON_INTERPRET)
    _m("layer_norm_dx_drops_mean_grad", "fusible/kernels/norms.py",
       "            dx = rstd * (g - c0 - x_hat * c1)\n",
       "            dx = rstd * (g - x_hat * c1)\n",
       "LayerNorm's whole-row backward forgets the mean of g (the centring's gradient)"),
    _m("swiglu_grad_drops_silu_term", "fusible/kernels/swiglu.py",
       "return dy * b * sig * (1.0 + a * (1.0 - sig)), dy * a * sig",
       "return dy * b * sig, dy * a * sig",
       "SwiGLU's backward takes sigmoid for the derivative of silu"),
    _m("gelu_tanh_fp8_constant", "fusible/kernels/activation_cast.py",
       "tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))",
       "tl.sigmoid(0.7978845608028654 * (x + 0.044715 * x * x * x))",
       "the FP8-writing tanh GELU uses sqrt(2/pi) where 2 sqrt(2/pi) belongs"),
    _m("norm_fp8_amax_of_unrounded", "fusible/kernels/norms.py",
       "    return y.to(x_ptr.dtype.element_ty).to(tl.float32), offs, mask",
       "    return y, offs, mask",
       "the FP8-writing norm takes its amax and cast from unrounded values (bits differ from "
       "norm-then-cast)"),
    # the fifth session's features, with their tests
    _m("amax_slots_not_rezeroed", "fusible/kernels/fp8_cast.py",
       "            self.buffer.zero_()\n", "            pass\n",
       "the casts' amax slots are handed out again without their fill"),
    _m("main_grad_overwritten", "fusible/runtime/features/main_grad.py",
       "            buffer.add_(g)\n", "            buffer.copy_(g)\n",
       "a weight gradient replaces main_grad instead of adding into it"),
    _m("in_place_fusion_out_of_place", "fusions/forward_linear_bias_add.py",
       "            y = r2.addmm_(tokens_2d(x), gemm.weight.t())",
       "            y = torch.addmm(r2, tokens_2d(x), gemm.weight.t())",
       "AddExtraInput(in_place=True)'s fused GEMM writes a new tensor, not the residual"),
    _m("fp8_param_transpose_stale", "fusible/quantization/tensor/ops.py",
       "        t._transpose.copy_(parts[2])\n", "        pass\n",
       "an in-place update of an FP8 weight leaves its transposed copy (dgrad's) stale"),
    _m("channel_fan_out_keeps_last", "fusible/runtime/features/channels.py",
       "call.store[name] = g if call.store.get(name) is None else call.store[name] + g",
       "call.store[name] = g",
       "a channel read twice passes back one reader's gradient"),
    _m("situ_gate_gradient_kernel", "fusible/kernels/swiglu.py",
       "    gate_grad = _tanh_grad(z) * sig + gate * tl.sigmoid(-a)",
       "    gate_grad = _tanh_grad(z) * sig + gate * sig",
       "SiTU-GLU's Triton gate derivative takes sigmoid' as sigmoid"),
    _m("situ_linear_cap_torch", "fusible/functional/activations.py",
       "    return gate, gate_grad, linear_scale * torch.tanh(w) + offset, _tanh_grad(w)",
       "    return gate, gate_grad, linear_scale * torch.tanh(w) + offset, _tanh_grad(z)",
       "SiTU-GLU's capped linear half has the wrong derivative on the PyTorch path"),
    _m("recompute_by_the_weight_amax", "fusions/recompute_norm_linear.py",
       "saved.rstd, saved.output_amax, args.normalized_shape,",
       "saved.rstd, saved.weight_amax if saved.weight_amax is not None else "
       "saved.output_amax, args.normalized_shape,",
       "RecomputeNormLinear quantizes the recomputed norm output by another tensor's scale"),
    _m("recompute_ignores_zero_centered_gamma", "fusions/recompute_norm_linear.py",
       "        y = cls._output_again(args, gamma) if wgrad else None",
       "        y = cls._output_again(args, saved.norm_weight) if wgrad else None",
       "the recomputed norm output multiplies by gamma where the forward used 1 + gamma"),
    _m("joint_claims_ignored_backward", "fusible/planning/planner.py",
       "    entries = {(lo + len(m) - 1 if reverse else lo): (op, m) for lo, (op, m) in "
       "claims.items()}",
       "    entries = {(lo + len(m) - 1 if reverse else lo): (op, m) for lo, (op, m) in "
       "claims.items() if not reverse}",
       "the backward scan plans the basic ops under a joint fusion, which read records "
       "it never saved"),
    _m("grouped_wgrad_skips_empty_groups", "fusible/functional/grouped.py",
       "    for g, (lo, hi) in enumerate(_ranges(splits)):\n        torch.mm(dy[lo:hi].t(), "
       "x[lo:hi], out=dw[g])",
       "    for g, (lo, hi) in enumerate(_ranges(splits)):\n        if hi > lo:\n"
       "            torch.mm(dy[lo:hi].t(), x[lo:hi], out=dw[g])",
       "an expert without tokens gets an uninitialised weight gradient instead of zeros"),
    _m("unpermute_ignores_capacity_drops", "fusible/moe.py",
       "index_copy_(0, order, torch.where(kept, slot, -1))",
       "index_copy_(0, order, slot.clamp(max=rows - 1))",
       "a copy dropped by the capacity gets another row's output instead of nothing"),
    _m("grouped_fp8_one_weight_scale", "fusible/functional/grouped_fp8.py",
       "    return torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), "
       "float(\"inf\"), dim=1,\n                                    dtype=torch.float32)",
       "    return torch.linalg.vector_norm(weight.reshape(1, -1), float(\"inf\"), dim=1,\n"
       "                                    dtype=torch.float32).expand(weight.shape[0])",
       "FP8 grouped GEMMs scale all the experts' weights by one scale, not each its own"),
    _m("grouped_fp8_unaligned_wgrad_unchecked", "fusible/ops/grouped_linear.py",
       "        check_aligned_splits(args.splits, \"GroupedLinear\")\n", "",
       "the FP8 weight gradient runs on groups the GPU kernel cannot take (a device assert "
       "there), without the error that says how to align them"),
    _m("combine_gradient_unweighted", "fusible/moe.py",
       "moe_rows.gather_rows(grad, row_copy, ctx.k, flat, y)",
       "moe_rows.gather_rows(grad, row_copy, ctx.k, None, y)",
       "the combine's gradient reaches the experts' rows without the router weights"),
    _m("align_loses_spare_rows", "fusible/moe.py",
       "    spare[-1] = rows - padded.sum()", "    spare[-1] = 0",
       "aligned routing's splits miss the spare rows: they no longer add up to the rows"),
    _m("all_to_all_backward_same_way", "fusible/ops/all_to_all.py",
       "        dx = parallel.all_to_all(args.grad_output, args.recv_counts.tolist(),\n"
       "                                 args.send_counts.tolist(), args.parallel)",
       "        dx = parallel.all_to_all(args.grad_output, args.send_counts.tolist(),\n"
       "                                 args.recv_counts.tolist(), args.parallel)",
       "the expert-parallel dispatch sends gradients back with the forward's counts"),
    _m("rowwise_cast_one_scale", "fusible/quantization/casts/rowwise.py",
       "amax = xf.abs().amax(1, keepdim=True) if xf.shape[1]",
       "amax = xf.abs().amax().expand(xf.shape[0], 1) if xf.shape[1]",
       "the row-wise cast scales every row by the tensor's amax"),
    _m("autocast_takes_unregistered_recipes", "fusible/quantization/recipes/autocast.py",
       "    if recipe is not None and not is_registered(recipe):",
       "    if recipe is not None and not isinstance(recipe, Recipe):",
       "autocast takes a recipe whose class is not registered (its key may name another)"),
    _m("scaled_glu_kernel_dx_unscaled", "fusible/kernels/scaled_glu.py",
       "da, db = _swiglu_grads(dy * s[:, None], a, b,", "da, db = _swiglu_grads(dy, a, b,",
       "the scaled unit's Triton backward forgets the router weight in the input gradient"),
    _m("mx_scale_rounded_down", "fusible/quantization/casts/blocks.py",
       "    e = biased - 127 + (mantissa != 0).to(torch.int32)\n",
       "    e = biased - 127\n",
       "MX scales rounded down (OCP's floor): a block's largest values saturate"),
    _m("tile_copy_reuses_data_scales", "fusible/quantization/casts/blocks.py",
       "    if columnwise and square:", "    if columnwise:",
       "a 1x128-tiled transposed copy reuses the data's tiles instead of its own rows'"),
    _m("emulated_gemm_drops_b_scales", "fusible/quantization/gemm.py",
       "    b32 = b.float() * expand_scales(scale_b.float(), b.shape)",
       "    b32 = b.float()",
       "the emulated blockwise GEMM forgets the second operand's scales"),
    _m("rowwise_gather_local_column_scales", "fusible/quantization/scalings/row.py",
       "            column_amax = max_over_group(local)", "            column_amax = local",
       "a row-wise TP gather scales the transposed copy by each rank's own column maxima"),
    _m("scale_blocks_not_powers_of_two", "fusible/quantization/casts/common.py",
       "    return tuple(n if s == 1 else 1 << max(0, -(-n // s) - 1).bit_length()",
       "    return tuple(n if s == 1 else -(-n // s)",
       "block sizes read as ceil(n / scales): ragged edges dequantized with the wrong scales"),
    # Delayed scaling (issue 16)
    _m("delayed_gather_local_amax", "fusible/quantization/scalings/delayed.py",
       "                                       self.delayed(state, max_over_group))[:2]",
       "                                       self.delayed(state))[:2]",
       "a delayed TP gather records each rank's own amax: the ranks' scales drift apart"),
    _m("delayed_dgrad_weight_rolled_scale", "fusible/functional/linear.py",
       "        w_amax = w_format.state[0].clone()\n",
       "        w_amax = w_format.state[0]\n",
       "dgrad casts the weight with the state after its roll, not the forward's scale"),
    _m("delayed_roll_keeps_oldest", "fusible/kernels/fp8_delayed.py",
       "    history = torch.cat([amax.reshape(1).float(), state[2:-1]])",
       "    history = torch.cat([amax.reshape(1).float(), state[3:]])",
       "the history shifts the wrong way: the oldest amax stays, the newest older ones go"),
    _m("delayed_margin_ignored", "fusible/kernels/fp8_delayed.py",
       "    scaled = newest * 2.0 ** margin\n",
       "    scaled = newest\n",
       "the margin is not applied to the scale's amax"),
    _m("delayed_producer_not_bound", "fusible/runtime/features/scaling_states.py",
       "            fmt = st.output_format.bound(call.ctxs[index].states[role])",
       "            fmt = st.output_format.bound(call.ctxs[0].states.get(role))",
       "a producer's FP8 hand-off casts with the group's first op's state, not its consumer's"),
    _m("delayed_state_not_written_back", "fusible/runtime/custom_ops.py",
       "        state.copy_(new)\n", "        pass\n",
       "compiled stages drop the updated states: the histories never advance when compiled"),
    # Data parallelism (issue 17)
    _m("fsdp_gather_local_amax", "fusible/quantization/fsdp_weight.py",
       "            dist.all_reduce(amax, dist.ReduceOp.MAX, group=mesh.get_group())",
       "            pass",
       "FP8 all-gathers cast each shard with its own scale: the gathered weight is not the "
       "weight quantized"),
    _m("fsdp_gather_before_mixed_precision", "fusible/quantization/fsdp_weight.py",
       "            shard = shard.to(mp_policy.param_dtype)", "            pass",
       "FP8 all-gathers quantize the float32 shard, not the bf16 weight the GEMMs would see"),
    _m("fsdp_transpose_not_refilled", "fusible/quantization/fsdp_weight.py",
       "                transposed_copy(data, out=out._transpose)",
       "                pass",
       "a gather after resharding leaves the freed transposed copy unfilled: dgrad reads junk"),
    _m("fsdp_swaps_move_the_epoch", "fusible/core/operation.py",
       "    return (isinstance(old, nn.Parameter) and isinstance(new, nn.Parameter)",
       "    return False and (isinstance(old, nn.Parameter) and isinstance(new, nn.Parameter)",
       "FSDP2's parameter swaps replan every step, and recompile every block every step"),
    _m("deferred_wgrad_overwrites_grad", "fusible/runtime/wgrad.py",
       "    if param.grad is None:\n        param.grad = g if",
       "    if True:\n        param.grad = g if",
       "a deferred wgrad replaces the accumulated gradient: microbatches lose all but the last"),
    _m("split_shared_cast_scaled_wrong", "fusible/functional/linear.py",
       "args.need_grad_weight:\n        dy = as_fp8(dy, args.grad_format)",
       "args.need_grad_weight:\n        dy = as_fp8(dy * 2, args.grad_format)",
       "the split's shared E5M2 cast scales dy wrong: FP8 dgrad and wgrad both off"),
    _m("optimizer_ignores_pending_wgrad", "fusible/runtime/wgrad.py",
       "    if not targets:\n        return\n    mine",
       "    if True:\n        return\n    mine",
       "an optimizer step runs with deferred wgrads not yet added: silently missing gradients"),
]

# Bugs nobody tuned the tests for (the "fresh" set): picked from the library's source
# alone, without reading tests/, to measure how the suite does on bugs it has not seen.
FRESH = [
    _m("dgrad_accumulate_weight_transposed", "fusible/functional/linear.py",
       "dx = torch.addmm(tokens_2d(accumulate_into), dy2, weight, alpha=alpha)",
       "dx = torch.addmm(tokens_2d(accumulate_into), dy2, weight.t(), alpha=alpha)",
       "the accumulating dgrad (BackwardLinearAdd) multiplies by weight.T: silently wrong "
       "for square layers"),
    _m("grad_sync_without_offset", "fusible/planning/features/grad_reduction.py",
       "sync += [(offset + k, group) for k in range(len(op.param_names))]",
       "sync += [(k, group) for k in range(len(op.param_names))]",
       "a fused backward stage all-reduces the wrong parameter gradients: the sequence-"
       "parallel Bias after a row-parallel linear has dweight summed over the group, not "
       "dbias"),
    _m("grad_format_columnwise_follows_input", "fusible/functional/linear_state.py",
       "recipe.grad_format(columnwise=needs.params[0])",
       "recipe.grad_format(columnwise=needs.input)",
       "dy's transposed FP8 copy (read by wgrad) kept when the input needs a gradient "
       "rather than the weight: wgrad of a first layer finds none"),
    _m("rms_norm_dx_mean_last_dim", "fusible/functional/norms.py",
       "dx = rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))\n        if accumulate",
       "dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))\n        if accumulate",
       "RMSNorm's dx averages over the last dimension only: wrong for a multi-dimensional "
       "normalized_shape"),
    _m("gelu_tanh_backward_exact", "fusible/functional/activations.py",
       'lambda dy, x: aten.gelu_backward(dy, x, approximate="tanh")',
       "lambda dy, x: aten.gelu_backward(dy, x)",
       "tanh GELU's backward uses the exact GELU derivative (forward stays tanh)"),
    _m("swiglu_backward_halves_swapped", "fusible/functional/activations.py",
       "    return _interleave(torch.cat([da, db], -1), interleave)\n",
       "    return _interleave(torch.cat([db, da], -1), interleave)\n",
       "SwiGLU's backward concatenates the gate and value gradients in the wrong order"),
    _m("dbias_sums_dy_not_dact", "fusible/functional/activations.py",
       "return dact, bias_grad(dact)",
       "return dact, bias_grad(grad_output)",
       "BackwardActivationBias's PyTorch path sums dy, not the activation gradient, "
       "into dbias"),
    _m("dequantize_in_outer_dtype", "fusible/quantization/casts/dequantize.py",
       "return (data.float() * expand_scales(scale_inv.float(), data.shape)).to(dtype)"
       ".contiguous()",
       "return (data.to(dtype) * expand_scales(scale_inv.to(dtype), data.shape)).contiguous()",
       "FP8 dequantization multiplies in the outer dtype (bf16 scale, bf16 product) "
       "instead of float32"),
    _m("cast_fake_transpose_shape", "fusible/quantization/casts/tensorwise.py",
       "x.new_empty((x.shape[-1], x.numel() // x.shape[-1]), dtype=fp8_dtype)",
       "x.new_empty((x.numel() // x.shape[-1], x.shape[-1]), dtype=fp8_dtype)",
       "the FP8 cast's fake kernel gives the transposed copy the untransposed shape: "
       "compiled FP8 graphs traced with wrong shapes"),
    _m("recipe_key_ignores_format", "fusible/quantization/recipes/base.py",
       'fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}"',
       'fields = "".join(""',
       "the recipe key leaves out fp8_format: switching hybrid/e4m3 keeps the first "
       "recipe's plans"),
    _m("dequantize_grad_e4m3", "fusible/quantization/tensor/float8_tensor.py",
       "return Float8Tensor._hooks.quantize(grad.contiguous(), torch.float8_e5m2)",
       "return Float8Tensor._hooks.quantize(grad.contiguous(), torch.float8_e4m3fn)",
       "Float8Tensor.dequantize()'s backward sends an E4M3 gradient instead of E5M2"),
    _m("needs_ignore_extra_inputs_upstream", "fusible/planning/passes.py",
       "upstream = upstream or any(params) or any(extras)",
       "upstream = upstream or any(params)",
       "an extra input that requires grad does not make the ops after it produce dgrad: "
       "the residual gets no gradient when x and the weights need none"),
    _m("backward_stage_filter_first_op", "fusible/planning/prepare.py",
       "if any(n.any for n in needs[es.lo:es.hi])]",
       "if needs[es.lo].any]",
       "a backward stage is kept only if its first op needs a gradient: "
       "BackwardLinearBias with a frozen weight (and input) drops dbias"),
    _m("priority_order_inverted", "fusible/planning/registry.py",
       "key=lambda i: (-_fusions[i].priority, i))",
       "key=lambda i: (_fusions[i].priority, i))",
       "fusion priority sorted ascending: among matches of equal length the lower "
       "priority wins"),
    _m("backward_reads_extra_in_slice", "fusible/runtime/executor.py",
       "op.backward_args(dy, extras[st.extra_out] if st.num_extra_out",
       "op.backward_args(dy, extras[st.extra_in] if st.num_extra_out",
       "a backward stage is handed the extra-output gradients sliced by its extra-input "
       "span"),
    _m("saved_inputs_skip_version_check", "fusible/runtime/saved.py",
       "            if id(t) in input_ids:\n                to_save.append(t)\n",
       "            if id(t) in input_ids:\n                pass\n",
       "saved inputs and parameters kept only in the record, not through "
       "save_for_backward: an in-place change after the forward goes undetected"),
    _m("autocast_extra_inputs_not_cast", "fusible/runtime/autocast.py",
       "extra_inputs = tuple(e.to(dtype) if e.is_floating_point() else e",
       "extra_inputs = tuple(e if e.is_floating_point() else e",
       "under torch.autocast the extra inputs are not cast to the autocast dtype"),
    _m("compiled_ignores_recipe", "fusible/runtime/compiled.py",
       "extra_inputs, current_key(),",
       "extra_inputs, None,",
       "the compiled path leaves the FP8 recipe out of its conditions: no guard on it, "
       "so a recipe change does not recompile"),
    _m("real_check_accepts_nan", "fusible/core/checks.py",
       "if minimum is not None and not cast(float, value) >= minimum:",
       "if minimum is not None and cast(float, value) < minimum:",
       "a real-valued argument with a minimum (eps) accepts NaN"),
    _m("hooks_miss_backward_pre", "fusible/core/hooks.py",
       '_LOCAL = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", '
       '"_backward_pre_hooks")',
       '_LOCAL = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")',
       "an op with only a full backward pre-hook is fused into its group: the hook never "
       "runs"),
    _m("all_reduce_backward_reduces", "fusible/ops/all_reduce.py",
       "return BackwardResult(args.grad_output if args.need_grad_input else None)",
       "return BackwardResult(parallel.all_reduce(args.grad_output, args.group) "
       "if args.need_grad_input else None)",
       "AllReduce's backward all-reduces the (replicated) gradient too: world_size times "
       "too large"),
    _m("quantize_backward_reads_forward_flag", "fusible/ops/quantize.py",
       "recipe is not None and self.backward_fp8 else None",
       "recipe is not None and self.forward_fp8 else None",
       "Quantize quantizes the gradient per its forward flag: Quantize() (backward=False) "
       "sends FP8 gradients"),
    _m("layer_norm_saves_only_for_dx", "fusible/ops/layer_norm.py",
       "        if ctx.needs.any:\n            ctx.saved = LayerNormSaved(",
       "        if ctx.needs.input:\n            ctx.saved = LayerNormSaved(",
       "LayerNorm saves for the backward only when its input needs a gradient: "
       "a first-layer LayerNorm's weight and bias gradients fail"),
    _m("cpu_epilogue_gelu_tanh", "fusions/forward_linear_bias_activation.py",
       'EPILOGUE_GELU = {"cuda": "tanh", "cpu": "none"}',
       'EPILOGUE_GELU = {"cuda": "tanh", "cpu": "tanh"}',
       "the CPU GEMM epilogue is taken for tanh GELU: inference computes exact GELU"),
    _m("layer_norm_eps_default", "fusible/ops/layer_norm.py",
       "eps: float = 1e-5",
       "eps: float = 1e-6",
       "LayerNorm's default eps 1e-6 instead of torch.nn.LayerNorm's 1e-5"),
    _m("zero_centered_gamma_without_one", "fusible/functional/norms.py",
       "return weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32) + 1",
       "return weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)",
       "a zero-centred gamma multiplies by gamma, not 1 + gamma"),
    _m("l2_normalization_backward_unprojected", "fusible/ops/l2_normalization.py",
       "return (rstd * (dyf - xf * (rstd * rstd * dot))).to(dy.dtype)",
       "return (rstd * dyf).to(dy.dtype)",
       "L2Normalization's input gradient forgets the norm's own dependence on the input"),
    _m("glu_gates_the_second_half", "fusible/functional/activations.py",
       "    a, b = _halves(x, interleave)\n"
       "    if kind == \"clamped_swiglu\":\n        gate, _, linear",
       "    b, a = _halves(x, interleave)\n"
       "    if kind == \"clamped_swiglu\":\n        gate, _, linear",
       "the gated units gate the second half (PyTorch's F.glu convention, not "
       "TransformerEngine's)"),
    _m("clamped_swiglu_gradient_through_the_clamp", "fusible/functional/activations.py",
       "        da = torch.where(a <= limit, dy * linear * gate_grad, 0.0)",
       "        da = dy * linear * gate_grad",
       "the clamped SwiGLU passes a gradient where the gate's clamp bites"),
    _m("interleaved_halves_read_chunked", "fusible/functional/activations.py",
       "    if not interleave or not x.numel():\n        return x\n    width",
       "    if True:\n        return x\n    width",
       "glu_interleave_size is ignored: the halves are read one after the other"),
    _m("gated_unit_after_column_accepted", "fusible/ops/glu.py",
       "        if self.glu_interleave_size is None:\n            raise ValueError(",
       "        if False:\n            raise ValueError(",
       "a chunked gated unit after a column-parallel layer is accepted (wrong pairs)"),
    _m("linear_scale_dropped_from_wgrad", "fusible/functional/linear.py",
       "        dw = (linear_wgrad(dy, _needed(x_saved), grad_scale, args.wgrad_dtype)",
       "        dw = (linear_wgrad(dy, _needed(x_saved), 1.0, args.wgrad_dtype)",
       "BackwardLinearScale forgets the scale in the weight gradient"),
    _m("add_rms_norm_branch_gradient_dropped", "fusible/functional/norms.py",
       "        if accumulate_into is not None:\n            dx = dx + _float(accumulate_into)",
       "        if accumulate_into is not None:\n            dx = dx + 0 * _float(accumulate_into)",
       "BackwardAddRMSNorm drops the residual branch's gradient"),
    _m("cached_launch_ignores_alignment", "fusible/kernels/__init__.py",
       "        return value.dtype, value.get_device(), not value.data_ptr() & 15",
       "        return value.dtype, value.get_device()",
       "a Triton launch reuses a kernel compiled for 16-byte aligned pointers on an "
       "unaligned one"),
    _m("glu_sigmoid_gradient_cancels", "fusible/functional/activations.py",
       "lambda g, a: g * torch.sigmoid(a) * torch.sigmoid(-a)),",
       "lambda g, a: g * torch.sigmoid(a) * (1 - torch.sigmoid(a))),",
       "GLU's gradient computes 1 - sigmoid(a), which cancels in float32 for large a"),
]

# Issue 40's work (the last two work items), audited: convert's modes, hooks and
# checkpoints, plan_model's restores, checkpoint_context, the execution features, delayed
# scaling's saturation, GroupedLinear's scaled bias, MoE edge cases, the CLI. Picked from
# the library's source and the commits, without reading tests/.
AUDIT_40 = [
    # fusible/models: convert, the merged gated MLPs, their checkpoints, residual adds
    _m("convert_leaf_takes_default_mode", "fusible/models/conversion.py",
       "return None if new is None else keep_hooks(module, new.train(module.training))",
       "return None if new is None else keep_hooks(module, new)",
       "a converted leaf is in train mode whatever the module it replaces (an eval model's "
       "Dropout drops again)"),
    _m("convert_drops_backward_hooks", "fusible/models/conversion.py",
       '"_forward_pre_hooks_with_kwargs", "_backward_hooks",',
       '"_forward_pre_hooks_with_kwargs",',
       "convert carries forward hooks but not the replaced module's (full) backward hooks: "
       "they silently never run"),
    _m("convert_overwrites_own_state_hooks", "fusible/models/conversion.py",
       "        if name in _STATE_HOOKS and own:\n",
       "        if name in _CALL_HOOKS and own:\n",
       "keep_hooks replaces the replacement's own state-dict hooks with the original's: a "
       "merged gated MLP saves gate_up.weight, not gate_proj/up_proj"),
    _m("convert_reparametrized_layers", "fusible/models/conversion.py",
       "new = None if make is None or _reparametrization(module) else make(module)",
       "new = None if make is None else make(module)",
       "convert no longer leaves spectral_norm / weight_norm / parametrized layers alone"),
    _m("gated_merge_halves_swapped", "fusible/models/gated_mlps.py",
       "torch.cat([gate.weight.detach(), up.weight.detach()])",
       "torch.cat([up.weight.detach(), gate.weight.detach()])",
       "the merged gate_up weight stacks up before gate: SwiGLU gates the up projection"),
    _m("gated_refusal_hook_never_installed", "fusible/models/gated_mlps.py",
       "    if not _HOOK:\n        _HOOK.append(",
       "    if _HOOK:\n        _HOOK.append(",
       "the optimizer-step guard is never registered: an optimizer holding a replaced "
       "gate/up weight steps silently"),
    _m("partial_checkpoint_loads_nothing", "fusible/models/checkpoint_names.py",
       "        if not any(present):\n",
       "        if not all(present):\n",
       "a checkpoint holding only one of gate/up (strict=False) loads none of the merged rows"),
    _m("missing_projection_not_reported", "fusible/models/checkpoint_names.py",
       "                missing_keys.append(name)\n",
       "                pass\n",
       "a projection missing from a checkpoint is not reported (strict=True loads it silently "
       "with stale rows)"),
    _m("hooked_linear_made_residual_linear", "fusible/models/residual_adds.py",
       "    if type(child) is Linear and not _has_call_hooks(child):\n",
       "    if type(child) is Linear:\n",
       "a Linear with hooks becomes a ResidualLinear: its hooks see (y, residual) and the "
       "sum, not the layer's own arguments and output"),
    # fusible/models/model_plan.py: planning does not train, every computing module shown
    _m("plan_model_buffers_not_restored", "fusible/models/model_plan.py",
       "                    b.copy_(before[name])\n",
       "                    pass\n",
       "plan_model leaves BatchNorm's running statistics (and amax histories) updated by its "
       "run"),
    _m("plan_model_rng_not_restored", "fusible/models/model_plan.py",
       "        torch.random.set_rng_state(rng)\n",
       "        pass\n",
       "plan_model consumes the CPU random generator (dropout's draws): later results differ"),
    _m("plan_model_nested_fp8_states_kept", "fusible/models/model_plan.py",
       'elif name.rsplit(".", 1)[-1].startswith("fp8_state_"):',
       'elif name.startswith("fp8_state_"):',
       "FP8 states a first plan made below the root keep the plan run's recorded amax, not "
       "zeros"),
    _m("plan_model_records_leaves_only", "fusible/models/model_plan.py",
       "        if m is not model:\n            found.append(m)\n",
       "        if m is not model and not list(m.children()):\n            found.append(m)\n",
       "only leaf modules are recorded: nn.MultiheadAttention (computing with out_proj's "
       "weight without calling it) disappears from the plan"),
    # activation checkpointing: each recomputation repeats its own forward
    _m("checkpoint_context_regions_apart", "fusible/runtime/recompute.py",
       '_entered("forward_region", region), _entered("recompute_region", region)',
       '_entered("forward_region", region), _entered("recompute_region", {})',
       "checkpoint_context's recomputation looks in a dict its forward never filled: it "
       "repeats the latest forward's recipe and scales"),
    _m("two_forwards_in_flight_not_ambiguous", "fusible/runtime/recompute.py",
       "if len(flight) > 1 and not all(flight[0].same_as(s) for s in flight[1:]):",
       "if len(flight) > 2 and not all(flight[0].same_as(s) for s in flight[1:]):",
       "two checkpointed forwards in flight under different recipes are not refused: the "
       "second recomputation repeats the first forward"),
    _m("recompute_grad_states_from_snapshot", "fusible/runtime/features/scaling_states.py",
       'return [t.clone() if role != "grad" else own\n',
       "return [t.clone()\n",
       "a recomputation casts gradients with a copy of the snapshot: a reentrant "
       "checkpoint's backward never advances the ops' gradient histories"),
    # execution features
    _m("in_place_leaf_check_never_fires", "fusible/runtime/executor.py",
       "outputs, tensors, extra_inputs, saves=save)",
       "outputs, tensors, extra_inputs)",
       "the forward's Call never says it saves: AddExtraInput(in_place=True) writes into a "
       "leaf requiring grad, autograd's error instead of the op's"),
    _m("split_wgrad_not_all_reduced", "fusible/planning/features/split_backward.py",
       "reduction.of(st.lo) if reduction is not None else ()))",
       "()))",
       "a deferred wgrad of a sequence-parallel parameter is not summed over its group"),
    _m("agreement_compares_class_names", "fusible/planning/features/parallel_agreement.py",
       'entries.append((f"op [{prep.start + i}] of the group", op.describe()))',
       'entries.append((f"op [{prep.start + i}] of the group", type(op).__name__))',
       "ranks compare their ops' class names only: column on one rank and row on the other "
       "(or other sizes) run with mixed-up collectives"),
    _m("ownerless_wgrads_never_taken", "fusible/runtime/deferred.py",
       "    return owner is None or owner == thread\n",
       "    return owner == thread\n",
       "compiled dgrads' wgrads (queued without an owner) belong to no thread: never taken, "
       "never run"),
    _m("pending_lists_every_thread", "fusible/runtime/wgrad.py",
       "for target in _pending_targets(threading.get_ident())]",
       "for target in _pending_targets()]",
       "a thread's forward is refused for another thread's deferred wgrads"),
    # delayed scaling: non-finite values stay non-finite; RecomputeNormLinear's refusal
    _m("saturate_inf_to_max", "fusible/quantization/casts/common.py",
       'torch.where(v.isinf(), torch.full_like(v, float("nan")), v.clamp(-limit, limit))',
       'torch.where(v.isnan(), torch.full_like(v, float("nan")), v.clamp(-limit, limit))',
       "the PyTorch casts saturate an inf to +-448 under delayed scaling: an overflow "
       "becomes finite and a skip-step guard never fires"),
    _m("kernel_saturate_inf_to_max", "fusible/kernels/fp8_cast.py",
       '    return tl.where(tl.abs(v) == float("inf"), float("nan"), clamped)\n',
       "    return clamped\n",
       "the Triton casts saturate an inf to the largest finite value"),
    _m("recompute_norm_linear_under_delayed", "fusions/recompute_norm_linear.py",
       "if fmt is not None and (not fmt.per_tensor or fmt.stateful):",
       "if fmt is not None and not fmt.per_tensor:",
       "RecomputeNormLinear is taken under delayed scaling: its recomputation casts from an "
       "advanced history"),
    # GroupedLinear(scale_bias=True)
    _m("scaled_bias_dbias_unscaled", "fusible/functional/grouped.py",
       'dbias = torch.segment_reduce(dy_acc * s_acc, "sum"',
       'dbias = torch.segment_reduce(dy_acc, "sum"',
       "the scaled bias's gradient sums dy, not dy * scale"),
    _m("scaled_bias_rounded_twice", "fusible/functional/grouped.py",
       "return (y.to(acc) + scales.reshape(-1, 1).to(acc) * rows).to(y.dtype)",
       "return y + (scales.reshape(-1, 1).to(acc) * rows).to(y.dtype)",
       "the scaled bias is rounded to bf16 before the add: two roundings, not one"),
    _m("scale_bias_grad_mask_wrong_slot", "fusible/ops/grouped_linear.py",
       "self.scale_bias and needs.extra_inputs[1], saved.bias,",
       "self.scale_bias and needs.extra_inputs[0], saved.bias,",
       "the scales' gradient follows the split sizes' mask (never needed): scales get no "
       "gradient"),
    # MoE routing
    _m("moe_capacity_rounded_down", "fusible/moe.py",
       "_round_up(math.ceil(capacity_factor * tokens * k / num_experts), align)",
       "_round_up(int(capacity_factor * tokens * k / num_experts), align)",
       "a fractional capacity share is rounded down: copies within the capacity dropped"),
    _m("moe_infinite_capacity_overflows", "fusible/moe.py",
       "            if not (capacity_factor > 0 and math.isfinite(capacity_factor)):\n",
       "            if not capacity_factor > 0:\n",
       "capacity_factor=inf passes the check and fails in math.ceil with an OverflowError"),
    _m("gather_rows_no_token_check_on_rows", "fusible/functional/moe_rows.py",
       "    if src.shape[0] == 0:  # no token",
       "    if row_copy.shape[0] == 0:  # no token",
       "a batch without tokens under align (padding rows only) indexes an empty tensor"),
    # activations
    _m("cached_activation_in_e5m2", "fusible/ops/pointwise_activation.py",
       "cast_tensorwise(kept, torch.float8_e4m3fn, False)",
       "cast_tensorwise(kept, torch.float8_e5m2, False)",
       "cache_quantized_input keeps the saved tensor in E5M2 (the gradients' format), not "
       "E4M3"),
    _m("situ_beta2_reads_beta1", "fusible/ops/swiglu.py",
       '"linear_scale", linear_scale, 25.0, "beta2", beta2)',
       '"linear_scale", linear_scale, 25.0, "beta2", beta1)',
       "SiTUGLU(beta1=..., beta2=...) caps the linear half with beta1"),
    # the command line, group checks, global hooks
    _m("cli_factory_kwargs_dropped", "fusible/cli.py",
       "model = load_factory(args.factory)(*factory_args, **factory_kwargs)",
       "model = load_factory(args.factory)(*factory_args)",
       "fusible plan --factory-args 'hidden=64' calls the factory without its keywords"),
    _m("group_type_accepts_names", "fusible/functional/parallel.py",
       "        if not isinstance(group, dist.ProcessGroup):\n",
       "        if not isinstance(group, (dist.ProcessGroup, str)):\n",
       "a group given as a string passes construction and fails at first use"),
    _m("global_hooks_flatten_linear", "fusible/module.py",
       "        if not root and (global_hooks or has_hooks(module)):\n",
       "        if not root and has_hooks(module):\n",
       "under global module hooks a Linear is flattened: the hooks see BasicLinear and Bias, "
       "never the Linear"),
]

SETS = {"curated": CURATED, "fresh": FRESH, "audit40": AUDIT_40}


def _run_tests(timeout: int, tests: tuple = ("tests",)) -> tuple:
    """(caught, seconds, the first failing test)."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        # Undecided, not caught: a slow run under load looks the same as a hang.
        return "timeout", time.monotonic() - start, f"timed out after {timeout} s: rerun it alone"
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    where = failed[0] if failed else ""
    if any(e in proc.stdout for e in ("NameError", "SyntaxError", "ImportError")):
        return None, time.monotonic() - start, where  # the mutation itself is broken
    return proc.returncode != 0, time.monotonic() - start, where


def related_tests(path: str) -> tuple:
    """The test files that name the module at ``path`` (its dotted name, or a public
    class or function it defines), or are named after it."""
    source = (ROOT / path).read_text()
    names = {node.name for node in ast.parse(source).body
             if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_")}
    module = pathlib.Path(path).with_suffix("")
    dotted = ".".join(module.parts[1:])  # fusible/ops/x.py -> ops.x
    pattern = re.compile(r"\b(" + "|".join([re.escape(dotted), *map(re.escape, sorted(names)),
                                            re.escape(f"import {module.name}")]) + r")\b")
    hits = [f for f in sorted((ROOT / "tests").glob("test_*.py"))
            if module.name in f.stem or pattern.search(f.read_text())]
    return tuple(str(f.relative_to(ROOT)) for f in hits)


def registry_tests_first() -> tuple:
    """The whole suite, the registry-driven matrix first (it runs every op, fusion and
    recipe: most mutations a module's own tests miss fail there)."""
    rest = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py"))
    return ("tests/test_matrix.py", *(f for f in rest if f != "tests/test_matrix.py"))


def _check_fusions_are_here() -> None:
    """The built-in fusions load as ``fusible.fusions``, which an editable install maps to
    its own checkout's fusions/: run elsewhere (a clone using another checkout's venv),
    mutations there would go untested and be reported as survivors, or worse, caught by
    nothing and passed over."""
    probe = subprocess.run([sys.executable, "-c", "import fusible.fusions as f; "
                            "print(list(f.__path__)[0])"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    where = pathlib.Path(probe.stdout.strip() or ".").resolve()
    if where != (ROOT / "fusions").resolve():
        raise SystemExit(f"fusible.fusions loads from {where}, not {ROOT / 'fusions'}: run the "
                         f"check in the checkout this Python installs (or pip install -e "
                         f"{ROOT} first)")


def run(mutations, timeout: int, related_first: bool = False) -> int:
    """Plant each mutation, run the tests, restore; print a table; return the survivors."""
    survivors = 0
    for m in mutations:
        path = ROOT / m.path
        text = path.read_text()
        if text.count(m.old) != 1:
            print(f"{m.name:36s} STALE  (its snippet occurs {text.count(m.old)} times in "
                  f"{m.path}: update the mutation)")
            survivors += 1
            continue
        path.write_text(text.replace(m.old, m.new))
        try:
            caught, seconds, where = None, 0.0, ""
            related = related_tests(m.path) if related_first else ()
            if related:
                caught, seconds, where = _run_tests(timeout, related)
            if caught is not True:
                caught, more, where = _run_tests(
                    timeout, registry_tests_first() if related_first else ("tests",))
                seconds += more
        finally:
            path.write_text(text)
        if caught is None:
            print(f"{m.name:36s} BROKEN (the mutated code does not run: fix the mutation)  "
                  f"{where}")
            survivors += 1
            continue
        survivors += caught is not True
        verdict = {True: "caught ", False: "SURVIVED", "timeout": "TIMEOUT "}[caught]
        print(f"{m.name:36s} {verdict} {seconds:6.0f} s  "
              f"{m.why}  {where}", flush=True)
    total = len(mutations)
    print(f"caught {total - survivors} of {total} ({100 * (total - survivors) / total:.0f}%)")
    return survivors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="curated", choices=sorted(SETS))
    parser.add_argument("--only", nargs="*", help="names of mutations to run")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--related-first", action="store_true",
                        help="run the tests naming the mutated module first")
    parser.add_argument("--check", action="store_true",
                        help="only check that every snippet occurs once")
    args = parser.parse_args()
    mutations = [m for m in SETS[args.set] if not args.only or m.name in args.only]
    if not mutations:
        sys.exit(f"no mutation of the {args.set} set is named {args.only}")
    if args.check:
        stale = [m.name for m in mutations if (ROOT / m.path).read_text().count(m.old) != 1]
        print(f"stale: {stale}" if stale else f"all {len(mutations)} snippets found once")
        sys.exit(1 if stale else 0)
    _check_fusions_are_here()
    sys.exit(1 if run(mutations, args.timeout, args.related_first) else 0)


if __name__ == "__main__":
    main()
