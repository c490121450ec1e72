/* moept.h - v0.1.0 - mixture-of-experts layer for training, in C.
   MIT licensed (see LICENSE in the repository).

   WHAT IT IS
     One MoE block (router -> top-k -> experts -> weighted combine, plus an
     optional shared expert), forward and backward, with the routers and
     losses of the families people train: Mixtral, Qwen2-MoE, OLMoE
     (softmax top-k, optional renormalisation) and DeepSeek-V3 (sigmoid,
     correction bias, group-limited top-k, routed scaling). Weights use the
     Hugging Face names and orientation ([out][in], y = x W^T), so HF
     checkpoints map without transposes.

   CONTENTS
     This comment: vendoring, compile-time options, usage, conventions
     (errors, group calls, numerics), routing, family defaults, losses,
     padding/evaluation/jitter, routing replay, inference layers, FP8
     training, parameter names. Then the
     declarations, each documented where it is declared: config,
     communication (the comm table and its backends), CUDA (the executor,
     its options and the NCCL backend), statistics, config_from_hf,
     lifecycle, parameters, compute, resharding, gradient sync, routing and
     statistics, safetensors, the optimizer and training checkpoints,
     Hugging Face checkpoints, the ABI report (for bindings). The rest of
     the file, after the "End of the API" line (MOEPT_INTERNAL), is moept.c's
     and moept_kernels.cu's, not API.
     Beyond this header: README.md (what runs where, quick start),
     docs/GUIDE.md (the training loop, parallelism, your own comm backend,
     checkpoints, errors), docs/CUDA.md (the GPU executor), docs/PERF.md
     (every measured figure), docs/DESIGN.md and docs/CUDA_INTERNALS.md.

   VENDORING
     Copy moept.h and moept.c into your project and compile moept.c as C11
     (C++ code includes moept.h and links moept.o). The builtin GEMM's
     kernel is picked from the target, so -march decides it:
         cc -O2 -std=c11 -c moept.c      x86-64: portable C kernel (4x8, no FMA)
         cc -O2 -std=c11 -march=native -fopenmp -c moept.c
                                         this CPU's kernel (AVX-512 or AVX2+FMA),
                                         threaded (-fopenmp: the GEMM and stages)
         cc -O2 -std=c11 -DMOEPT_CBLAS -c moept.c   (cblas_sgemm: OpenBLAS)
     moept_gemm_kernel() names the kernel a build has. The link line, for
     every build (the same in README.md):
         cc your.o moept.o -lm -pthread
     adding -fopenmp when moept.c was compiled with it and -lopenblas with
     MOEPT_CBLAS (-pthread: the threads backend; libm: exp, sqrt).

   COMPILE-TIME OPTIONS
     MOEPT_CBLAS        expert GEMMs through cblas_sgemm instead of the
                        builtin cache-blocked GEMM.
     MOEPT_GEMM_PORTABLE  the builtin GEMM's portable C kernel even where an
                        AVX-512, AVX2+FMA or NEON one exists (the kernel is
                        otherwise picked from the target: -march matters).
     MOEPT_NO_IO        compiles the file formats out (JSON, safetensors,
                        Hugging Face and training checkpoints: about a
                        quarter of moept.c); their functions are then not
                        defined (a call to one fails to link).
     MOEPT_NO_VEC       the activations' plain scalar loops instead of
                        GCC/clang vector types (bitwise the same results).
     MOEPT_MPI          the MPI backend (moept_comm_mpi); compile with mpicc.
     MOEPT_CUDA         the CUDA executor and NCCL backend: compile moept.c
                        with -DMOEPT_CUDA -I$CUDA_HOME/include, compile
                        moept_kernels.cu with nvcc (it includes moept.c's
                        shared math: keep the three files together), link
                        -lcudart -lcublas -lcublasLt -lnccl -lstdc++ (see docs/CUDA.md).
     MOEPT_MALLOC(n), MOEPT_FREE(p)
                        override the allocator (define before moept.c).
                        Every allocation is counted in moept_stats.

   USAGE
     moept_config cfg = moept_config_default(MOEPT_FAMILY_MIXTRAL); // C and C++
     cfg.hidden_size = 512; cfg.intermediate_size = 1024;
     cfg.num_experts = 8;   cfg.top_k = 2;
     cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.01f;
     cfg.max_tokens = 4096;
     // or a Hugging Face model's layer 1, sizes and routing from its config.json:
     //   moept_config_from_hf("path/to/model", 1, &cfg); then moept_load_hf
     moept_layer *L;
     if (moept_create(&cfg, &L) != MOEPT_OK) puts(moept_last_error(NULL));
     moept_set_param(L, "experts.3.w1.weight", w, F * D);   // [F][D]
     moept_forward(L, x, T, y);          // x [T][D] -> y [T][D]
     moept_backward(L, x, dy, dx);       // dy [T][D] -> dx [T][D], grads +=
     float *g; int64_t n; moept_grads(L, &g, &n);  // one contiguous range
     // (any layer, a CUDA layer's too: moept_buf_read(L, MOEPT_BUF_GRADS, 0, n, g))
     moept_zero_grad(L);
     moept_destroy(L);

   CONVENTIONS
     The library's contract, stated here and nowhere else (errors, group
     calls and what "one rank's error is every rank's" means; docs/GUIDE.md
     and docs/DESIGN.md refer here).
     - All row-major float32. x, y, dx, dy are [T][hidden_size].
     - Gradients accumulate across moept_backward calls until
       moept_zero_grad (as in PyTorch). They are gradients of
           L = sum(y * dy) + aux_loss_coef * aux_loss + z_loss_coef * z_loss
       (moept_backward_ex: the two losses times router_loss_scale, plus the
       caller's own router loss through dlogits).
     - moept_backward must be given the same x as the last moept_forward
       (the same values): the CPU executor checks a fingerprint of every
       element and rejects any other x with MOEPT_ERR_INVALID_ARGUMENT
       (the CUDA executor does not check: its shared expert's gradients,
       and at one rank in the kernel GEMM form its routed experts' W13
       gradients, are computed from the x the backward is given).
     - A call that changes the weights between a forward and its backward
       (moept_set_param of a weight, moept_init_params, moept_load_checkpoint,
       moept_load_hf, moept_adamw_step, moept_cuda_params_changed) makes
       every pending forward's backward fail with MOEPT_ERR_STATE naming the
       call (its gradients would mix the old activations with the new
       weights), on both executors; the forwards' routing and counts stay
       readable (moept_update_bias, moept_routing). moept_reshard drops the
       pending forwards (their plans used the old placement).
     - Aliasing: y may overlap x (every read of x comes before the first
       write of y; x is then gone, so a backward needs its values from
       elsewhere), dx may overlap dy (likewise); dx must not overlap x (the
       weight gradients read x after dx is written): rejected with
       MOEPT_ERR_INVALID_ARGUMENT, on both executors.
     - Every call returns a moept_status. On failure moept_last_error says
       why: one channel, the calling thread's last failure message whatever
       call it came from (a layer's, moept_create, moept_config_from_hf, a
       file reader), read through any argument (the layer, or NULL: the
       same text). A successful call does not clear it (read it right after
       the failing call); another thread's failures are that thread's. And
       the layer is left exactly as it was: parameters, gradients, bias, the saved
       forward state and the step statistics (steps, tokens, routed and
       dropped rows, capacity, losses, rows and bytes sent and received,
       checkpoint_bytes_read). The memory and time counters (allocations,
       allocated_bytes, workspace_bytes, host_bytes, device_bytes,
       recv_capacity, recv_growths, the *_seconds) count what happened: an
       EP step that grew a rank's receive buffers before a peer rejected it
       keeps the larger buffers (and their rows), and the time spent
       agreeing is time spent.
     - Group calls. Under EP/DP (FSDP: its group in place of EP) the
       calls below are collective: each rank checks its arguments (the
       loads: reads into a staging copy), then all agree before anything
       changes. The agreement carries the call's tag (which call, and the
       layer's count of agreed calls) and a fingerprint of the arguments
       that must be the same on every rank:

         call                   agreed over          arguments that must match
         moept_forward          EP (DP too with      none: each rank's tokens, T,
                                global_balance)      mask, eval and replay_ids are
                                                     its own
         moept_backward(_ex)    EP                   router_loss_scale (1 for
                                                     moept_backward)
         moept_sync_grads       EP, DP               scale
         moept_grad_norm        EP                   none
         moept_update_bias      EP, DP               rate
         moept_adamw_step       EP, DP               lr, beta1, beta2, eps,
                                                     weight_decay (0s as defaulted)
         moept_save_checkpoint  EP, DP               dir (*)
         moept_load_checkpoint  EP, DP               dir (*)
         moept_load_hf          EP, DP               dir (*), layer_index
         moept_reshard          EP, DP               new_rank[0..E)
         (*) as realpath(3) resolves it ("ck" and "./ck" are one directory);
             as given where it does not exist yet

       moept_create_parallel and moept_create_cuda are collective too (they
       agree on the config); every other call is local. One rank's
       rejection fails the call on every rank of the layer's groups (the
       others with MOEPT_ERR_STATE, "other rank(s) rejected"); arguments
       that differ, each valid on its own rank, fail every rank with
       MOEPT_ERR_INVALID_ARGUMENT, "passed different ..."; ranks making different calls (forward on one,
       reshard on another, or one call more) all fail with
       MOEPT_ERR_STATE, "call sequences differ", instead of running into
       each other's collectives, over every backend. None waits in a
       collective a peer skipped, and nothing is written, moved or deleted
       before the agreement. Not detected: a rank that makes no call at
       all (it died, or skipped one): the threads and NCCL backends end
       the wait at their timeout with an error on every waiting rank; MPI
       has no timeout (it cannot cancel a collective) and waits, as any
       blocking MPI program; Open MPI's mpirun ends the job when a rank
       process dies. Nor does the tag name the layer: two layers of one
       config over the same groups, called in a different order on two
       ranks whose counts happen to agree, are not told apart (create and
       call layers in the same order on every rank). On the
       CUDA executor the tag rides in the forward's count exchange and in
       the backward's agreement (a message of the same shape), so a forward
       against a backward fails on both ranks at no extra synchronisation;
       with unchecked_backward the backward does not agree at all. A NULL
       layer cannot take part (it has no groups) and fails locally.
     - Finite inputs that give a non-finite output or loss (an overflow in
       the experts; a loss counts where its coefficient is > 0) fail the
       forward on every rank with MOEPT_ERR_NUMERIC and the statistics
       unchanged; where a parameter is not finite (written through
       moept_params, moept_set_param or a load), the message names it and
       its element instead of blaming an overflow (a CUDA layer's: the
       backward that reports its y). The one
       exception to "left exactly as it was": the
       experts' saved activations are that step's by then, so backward and
       update_bias are refused until the next forward. On the CUDA
       executor a non-finite loss fails the forward the same way (it is
       known at the forward's one host synchronisation); y is checked on
       the device and reported by the next backward's synchronisation,
       which then fails on every rank with MOEPT_ERR_NUMERIC before any
       gradient changes and drops the step (a second host sync in the
       forward would stall the host's run-ahead; with unchecked_backward
       nothing reports it). A CPU backward whose dx comes out non-finite
       from a finite dy fails on every rank of the EP group with
       MOEPT_ERR_NUMERIC and the statistics unchanged. Gradients that were
       zero before it (zero_grad, forward, backward) are zero again,
       bitwise. Gradients that held earlier micro-batches are as they were
       too, bitwise, with config.grad_backup (a second copy of every
       gradient, taken by each accumulating backward); without it they keep
       this one's partial sums, and moept_adamw_step and moept_grad_norm
       refuse them on every rank, naming dx, until moept_zero_grad, as
       mixed-precision training skips a step whose gradients overflowed.
       The CUDA backward checks dx, and opts.dlogits (a CPU backward refuses
       a non-finite one at the call), on the device without a host sync: its
       next moept_adamw_step or moept_grad_norm reads the checks and refuses
       the same way, naming dlogits first (no grad_backup there). Nothing
       non-finite reaches the parameters or the optimizer state:
       moept_adamw_step also refuses non-finite gradients (moept_grad_norm
       then returns their Inf or NaN norm).
     - The library never prints, exits or aborts. Per-step work performs no
       allocation (checked through moept_stats.allocations).
     - Top-k ties go to the lower expert index; all sums are in a fixed order,
       so results are bitwise reproducible for a given build and thread count
       (and independent of the thread count with the builtin GEMM).

   ROUTING (fp32)
     softmax families (mixtral, qwen2_moe, olmoe):
         p = softmax(logits); ids = top-k(p); w = p[ids];
         if norm_topk_prob: w /= sum(w)
     deepseek_v3:
         s = sigmoid(logits); c = s + correction_bias;
         group score = sum of the top 2 c in each of n_group groups;
         keep the topk_group best groups; the others' experts take
         config.group_fill: -inf (default; DeepSeek's reference and
         transformers >= 5.6: never chosen) or 0 (MOEPT_GROUP_FILL_ZERO:
         transformers <= 5.5 and DeepSeek-V3's first modeling_deepseek.py,
         where an excluded expert beats a kept one whose c is negative);
         ids = top-k(c); w = s[ids];
         if norm_topk_prob: w /= sum(w) + 1e-20;  w *= routed_scaling_factor
       The correction bias only selects experts and gets no gradient;
       moept_update_bias() implements aux-loss-free balancing.

   FAMILY DEFAULTS (a config whose other fields are zero behaves as the
   family's transformers block: zero takes these)
     family        norm_topk_prob  shared gate  activation  routed_scaling
     mixtral       on (always)     -            silu gated  1
     qwen2_moe     off             sigmoid      silu gated  1
     olmoe         off             -            silu gated  1
     deepseek_v3   on              none         silu gated  0 = 1 (set it:
                                                            2.5 for V3)
     Sizes (hidden, expert and shared widths, experts, top-k, n_group,
     topk_group) are the model's: set them, or read them from config.json
     with moept_config_from_hf. Losses are off unless set. Qwen3-MoE is
     qwen2_moe with shared_intermediate_size 0.

   LOSSES
     MOEPT_AUX_HF:       E * sum_e (count_e / T) * mean_t softmax(logits_t)_e,
                         counts from the top-k of softmax(logits), exactly as
                         transformers' load_balancing_loss_func.
     MOEPT_AUX_MEGATRON: E * sum_e count_e / (T*K) * mean_t score_t,e with the
                         router's own selection and scores (softmax, or
                         sigmoid normalised over experts), as Megatron-Core.
                         It equals the HF value / K for softmax routers.
     MOEPT_AUX_SEQ:      DeepSeek-V3's complementary sequence-wise balance
                         loss (Megatron-Core's seq_aux_loss): MOEPT_AUX_MEGATRON
                         over each sequence on its own, averaged over the
                         sequences. Rows [s*S, (s+1)*S) of a forward's x are
                         sequence s (batch-major, as Hugging Face's [B, S]
                         flattened; Megatron-Core lays tokens out [S, B]:
                         transpose). A sequence's T is its unmasked tokens;
                         an all-padding sequence is not counted. Global
                         balance averages over every rank's sequences (a
                         sequence is never split over ranks).
     z_loss:             mean_t (logsumexp_e logits_t,e)^2.
     Counts are taken before capacity dropping.

   PADDING, EVALUATION, ROUTER JITTER (moept_forward_ex)
     opts.mask [T] (0 = padding): a padded token is routed nowhere, its y
     and dx rows are 0, and it is in no loss or count: the aux and z losses
     average over the unmasked tokens (global balance: over every rank's).
     Unmasked tokens get the values they would get without the padding
     rows, bitwise (the CUDA executor: up to the order of its loss sums).
     What a padded row of x, dy or opts.dlogits holds changes nothing: it
     is not checked (NaN, Inf, anything), the shared expert and the
     router's gradient see zeros there, and every output, loss and
     gradient is the zero-padded call's, bitwise. (A padded row's router
     logits, which moept_routing reports, are computed from it, as
     transformers' router does; its x still counts in backward's check
     that x is the forward's.) A CPU layer allocates max_tokens x
     hidden_size floats at its first masked forward for the router
     gradient's zero-padded input. A CUDA layer's mask is device memory, as
     x and y are (a host pointer fails the call: MOEPT_ERR_INVALID_ARGUMENT
     on the rank that passed it, MOEPT_ERR_STATE on its peers; in the
     sync-free mode its peers learn at their next moept_adamw_step or
     moept_grad_norm); an F32 one, or one with a shared expert, allocates
     max_tokens x hidden_size elements of its dtype at its first masked
     forward (x with its padded rows zero: the shared expert's input, and
     F32, the router gradient's; a BF16 layer zeroes its fp32 copy of x),
     so run one masked forward before capturing a step in a CUDA graph.
     opts.eval = 1: no jitter, nothing kept for backward (FORWARD SLOTS: it
     leaves every training forward's saved state as it was).
     config.router_jitter = eps: a training forward routes on x * u, u
     uniform in [1 - eps, 1 + eps] per element (as Switch Transformer and
     Megatron-Core's input jitter); the experts and the shared expert see x.
     transformers' Mixtral block (router_jitter_noise, which
     moept_config_from_hf reads) multiplies its input in place, so its
     experts see the noise too: to get that, multiply x yourself. u is drawn
     from (jitter_seed, the AdamW step count, training forwards since that
     step, the token's values, d): a token draws the same on any rank and
     EP size (EP = N equals EP = 1 on the whole batch), a resumed run draws
     what the original drew, and equal tokens draw equal noise. The
     backward treats u as a constant, as PyTorch does with its noise tensor.
     A CUDA layer draws the CPU layer's noise, bitwise (one generator).

   FORWARD SLOTS (config.max_inflight, opts.slot; both executors)
     Several training forwards of one layer in flight, each differentiated
     later, in any order: activation recomputation, pipeline schedules with
     several micro-batches in flight (1F1B), an evaluation in between. A
     layer keeps max(1, max_inflight) saved forwards, in slots
     0..max_inflight-1: a training forward saves its state in
     moept_forward_opts.slot (replacing what that slot held: forward again
     into a slot to recompute it), and moept_backward_ex differentiates the
     forward in moept_backward_opts.slot. The plain calls, a zeroed or NULL
     opts and moept_backward_default() use slot 0: today's one saved
     forward. Each slot's forward is differentiated once; the backward of a
     slot with no forward, or one already differentiated, returns
     MOEPT_ERR_STATE. A slot outside 0..max_inflight-1 returns
     MOEPT_ERR_INVALID_ARGUMENT; under EP every rank must name the same slot
     (agreed with the call, as its other arguments; so must opts.eval): a
     difference fails every rank and changes nothing (a CUDA layer's
     sync-free forward reports it at the next moept_adamw_step or
     moept_grad_norm; its unchecked_backward and sync-free backwards agree
     nothing: the slot is the caller's to keep alike, as their other
     arguments). Any order gives what forward, backward in sequence gives,
     bitwise (y, dx, every gradient): the router jitter
     is keyed by the count of training forwards, not by their slots (a
     recomputed forward is a new training forward and draws new noise: the
     backward differentiates the one made last into its slot). An
     evaluation forward (opts.eval) keeps nothing and needs no slot: a
     training layer runs it in its own workspace where a training forward
     may still wait for its backward (several slots, or one whose forward
     was not differentiated yet), so forward, evaluation, backward equals
     forward, backward; else (one slot, its forward differentiated) in the
     training slot, adding no memory. Each slot holds its own forward state
     (no data moves between slots; a call works on the slot it names).
     Memory: each slot used, and a training layer's first evaluation in its
     own workspace, add one slot's forward state: the routing, plan,
     exchange layout, activations and receive rows (on a CUDA layer on the
     device, with the send rows: docs/CUDA.md, "Memory"), less than the
     create's workspace_bytes (device_workspace_bytes): the layer's scratch
     (the builtin GEMM's packing, cuBLAS's workspace) is shared.
     Allocated at the slot's first forward (out of memory: that forward
     fails on every rank, nothing changed); its receive rows grow with a
     step's rows as slot 0's do. workspace_bytes (CPU) and
     device_workspace_bytes (CUDA) count every slot's.
     Parameters, gradients and AdamW state are the layer's, shared by the
     slots. moept_routing, moept_get_stats and moept_update_bias read the
     last forward call's (an evaluation's included), whatever backwards ran
     since; moept_routing_grads the backward of that forward, once it ran;
     moept_reshard drops every slot's forward. Both executors run the same
     rules, and a CUDA layer's slots equal the sequential run bitwise as the
     CPU layer's do (tests/test_slots.c, built for both).

   ROUTING REPLAY (opts.replay_ids of moept_forward_ex; both executors)
     Reinforcement learning on MoE models trains on the experts the rollout
     used (Megatron-Core's "router replay", R3): routing that differs
     between the inference engine and the trainer destabilises training.
     The recipe: record each rollout's choice, ids [T][K] from
     moept_routing after the rollout's forward (global expert indices, in
     the router's order: score descending, ties to the lower index; -1 for
     padding), or the inference engine's own top-k ids; then train with
     them as opts.replay_ids [T][K]: token t goes to experts
     replay_ids[t][0..K), with weights recomputed from the current router's
     logits as the family weighs its own choice (ROUTING above: softmax
     p[ids], divided by their sum with norm_topk_prob; deepseek_v3 s[ids],
     divided by their sum + 1e-20 with norm_topk_prob, times
     routed_scaling_factor; no group limit, and the correction bias, which
     only selects, plays no part). The backward differentiates those
     weights, so the router learns from the rollout's experts. The losses
     count the replayed experts wherever they count the router's selection
     (MOEPT_AUX_HF on softmax routers, MOEPT_AUX_MEGATRON, MOEPT_AUX_SEQ;
     MOEPT_AUX_HF on deepseek_v3 counts softmax's own top-k, never the
     router's choice; the z loss reads only the logits); capacity drops by
     position as without replay.
     Order: any order within a row, kept: moept_routing returns the row as
     given, weights[t][k] belongs to replay_ids[t][k], and the K-term sums
     (the weights' sum, the combine) run in that order, so a permuted row
     gives the same experts and values up to the rounding of those sums.
     Replaying a forward's own ids, as moept_routing returned them, equals
     that forward bitwise (y, dx, every gradient, the loss statistics;
     router_jitter aside, whose noise is new each training forward). The
     ids are global expert indices: a rollout recorded at one EP size
     replays at another (the same token, the same values: bitwise, the
     router's gradients, summed over other ranks, to rounding). A row of
     an unmasked token that is not K distinct experts of 0..E-1 rejects the
     call (MOEPT_ERR_INVALID_ARGUMENT, naming [t][k]), agreed over the
     groups as every forward check: every rank fails and nothing changes.
     A padded token's row (opts.mask) is not read: it may hold anything
     (the -1 rows of a recorded padded batch replay with its mask). CUDA
     layers: replay_ids is device memory, as x is; the device checks it and
     the forward's count exchange agrees on it (sync-free mode: reported by
     the next moept_adamw_step or moept_grad_norm, as a non-finite x is).

   INFERENCE LAYERS (config.inference_only = 1)
     Every forward is an evaluation (no jitter), with the same y and
     routing as a training layer's forward, bitwise (builtin GEMM; a CUDA
     layer: the same executor's training layer's). It holds
     no gradients and keeps nothing for backward: per rank, 4 * (n_params
     + Rcap * F + T * (K + E) + T * (S + 1) if S > 0) bytes less, Rcap the
     receive rows (moept_stats.recv_capacity), T max_tokens (the
     activations are written over the pre-activations' gate half). With
     router_jitter, 4 T (D + 4) more; chunked (overlap_chunks > 1), 4 Rcap
     (F + D) more; fsdp, the gathered gradient. Mixtral-8x7B's layer at
     EP = 8 and 8192 tokens a rank (Rcap >= T K): >= 705 MB of gradients
     and 940 MB of activations less per rank. moept_backward, grads,
     zero_grad, sync_grads, grad_norm and adamw_step return MOEPT_ERR_STATE
     ("inference_only"), alike on every rank; parameters load, save and
     reshard as in a training layer (moept_param_info's grad is NULL). A
     CUDA inference layer holds no gradients and no AdamW moments on the
     device either (moept_cuda_params' grads is NULL), and its activations
     the same way (docs/CUDA.md, "Memory").

   FP8 TRAINING (config.fp8 = MOEPT_FP8_BLOCKWISE; CPU and CUDA layers)
     DeepSeek-V3's recipe (its paper, section 3.3): every GEMM of the
     experts' FFNs (forward, dgrad and wgrad of W13 and W2; the shared
     expert's too) takes its operands quantized to E4M3 (OCP FP8: largest
     448, subnormals down to 2^-9, no infinities) and accumulates in fp32:
       token rows (x, the activations a, dy, dh): a scale per 1 x 128 tile
         along the GEMM's reduction dimension (D, F, or H = 2F of a row;
         for the wgrad, 128 rows of one expert along each column). The
         routed experts' x is quantized once, as its rows are dispatched:
         their W13 gradient's x is those rows' values quantized down the
         columns (DeepSeek-V3's workflow for an activation kept in FP8:
         the experts never see x itself). Under EP the exchange moves
         them as FP8 records: the row's D E4M3 bytes padded with zeros to
         a multiple of 16, then its ceil(D / 128) fp32 scales, padded to
         a multiple of 16 bytes (7,392 bytes for D = 7,168), bytes_sent
         counts them (a CPU layer whose ranks share memory writes the
         quantized values into the experts' rows instead). The routed
         experts' dy alike: each row w dy is quantized once, as combine'
         makes it, the W2 dgrad reads it, the W2 gradient's dy is those
         values quantized down the columns, and the backward's dispatch
         sends records; the combine's and the backward's returns move
         rows of the layer's dtype;
       weights: a scale per 128 x 128 block of W13 [H][D] and W2 [D][F]
         (W and W^T have the same blocks). The tiles run over the fused
         gate|up rows: where F is a multiple of 128, as in every released
         model, they are the separate projections' own.
     A tile's scale is s = max(amax / 448, 2^-63) from its own values (an
     edge tile of fewer elements alike); each v becomes s * e4m3(v / s),
     rounded to nearest even and saturating. The floor keeps every product
     of two scales (what a block-scaled GEMM multiplies a block's E4M3 sum
     by) at or over fp32's least normal, 2^-126: a tile whose amax is under
     448 * 2^-63 (about 4.9e-17) keeps its values in steps of 2^-72, and
     those at or under 2^-73 become 0, on every executor. The router,
     its losses, the shared expert's gate, the combine, the master weights,
     gradients and AdamW stay fp32. The CPU layer computes exactly this (the
     operands quantized and dequantized, then its fp32 GEMMs): the spec a
     GPU's FP8 GEMMs are held to. Results differ from fp32 by E4M3's
     precision (u = 2^-4 a rounding; tests/moept_check.c's --dtype fp8 bound
     and docs/GUIDE.md). The quantized weights are made at each forward,
     since a CPU layer's weights may be written through moept_params'
     pointer at any time (the memory of one copy of the experts' weights,
     in workspace_bytes and host_bytes' CASTS; a pass over them a forward).
     A CUDA layer runs the same tiles on cuBLASLt's block-scaled FP8
     matmuls (E4M3 bytes with fp32 scales, one call per expert GEMM), its
     rows between the stages in options.dtype; its dispatch writes the
     FP8 records, and its backward's combine dy's (the grouped kernel's
     form reads them as they are). Its
     E4M3 weights (W13, W2 and their transposes, for the dgrads) are made
     once after the fp32 masters change, and counted in
     device_workspace_bytes (device_bytes' CASTS). It equals the CPU's FP8 layer but for accumulation order,
     which moves a few E4M3 roundings (docs/CUDA.md, "FP8": the bound);
     link -lcublasLt. On an H200 not yet faster than the bf16 layer
     (docs/PERF.md).
     It needs compute capability 9.0 and cuBLAS 12.9 (refused at create,
     MOEPT_ERR_UNSUPPORTED, on anything older). With overlap_chunks > 1 a
     chunk's rows are quantized as the whole step's and the wgrads run over
     whole experts once every chunk is in: bitwise the one-chunk step on the
     CPU. Refused at create with FSDP sharding.

   PARAMETER NAMES (per family, the HF module-relative names)
     all:          gate.weight [E][D]
     deepseek_v3:  gate.e_score_correction_bias [E]   (a buffer, no gradient)
     mixtral:      experts.{e}.w1.weight [F][D] (gate)  .w3.weight [F][D] (up)
                   experts.{e}.w2.weight [D][F] (down)
     others:       experts.{e}.gate_proj.weight, .up_proj.weight [F][D],
                   experts.{e}.down_proj.weight [D][F]
     non-gated activations (gelu, relu): mixtral w1 (in) and w2 (out);
                   others up_proj (in) and down_proj (out).
     shared expert (shared_intermediate_size S > 0):
                   shared_expert.{gate,up,down}_proj.weight  [S][D],[S][D],[D][S]
                   (deepseek_v3: shared_experts.*), and with a sigmoid gate
                   shared_expert_gate.weight [1][D].
*/
#ifndef MOEPT_H
#define MOEPT_H

#include <stddef.h>
#include <stdint.h>
#ifdef MOEPT_MPI
#include <mpi.h>
#endif
#ifdef MOEPT_CUDA
#include <nccl.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define MOEPT_VERSION_MAJOR 0
#define MOEPT_VERSION_MINOR 1
#define MOEPT_VERSION_PATCH 0

typedef enum moept_status {
    MOEPT_OK = 0,
    MOEPT_ERR_INVALID_ARGUMENT = 1, /* bad config field, NULL pointer, bad size */
    MOEPT_ERR_OUT_OF_MEMORY = 2,
    MOEPT_ERR_NOT_FOUND = 3,        /* unknown parameter name, missing tensor */
    MOEPT_ERR_NUMERIC = 4,          /* NaN/Inf in inputs or router logits */
    MOEPT_ERR_STATE = 5,            /* e.g. backward without a forward */
    MOEPT_ERR_IO = 6,               /* file errors */
    MOEPT_ERR_FORMAT = 7,           /* malformed file */
    MOEPT_ERR_COMM = 8,             /* communication backend error */
    MOEPT_ERR_UNSUPPORTED = 9,      /* not in this build, or not on this kind of layer */
    MOEPT_ERR_DEVICE = 10           /* CUDA or cuBLAS error (call and line in the message) */
} moept_status;

typedef enum moept_dtype {
    MOEPT_DTYPE_F32 = 0, MOEPT_DTYPE_F16 = 1, MOEPT_DTYPE_BF16 = 2,
    MOEPT_DTYPE_F64 = 3, MOEPT_DTYPE_I64 = 4, MOEPT_DTYPE_I32 = 5,
    MOEPT_DTYPE_U8 = 6, MOEPT_DTYPE_BOOL = 7,
    MOEPT_DTYPE_F8_E4M3 = 8 /* float8_e4m3fn (read only: FP8 checkpoints) */
} moept_dtype;

/* config.fp8: the expert GEMMs' operands in FP8 (FP8 TRAINING) */
typedef enum moept_fp8 {
    MOEPT_FP8_OFF = 0,
    MOEPT_FP8_BLOCKWISE = 1 /* E4M3, DeepSeek-V3's tiles: rows 1 x 128, weights 128 x 128 */
} moept_fp8;

typedef struct moept_layer moept_layer;

typedef enum moept_family {
    MOEPT_FAMILY_MIXTRAL = 0,
    MOEPT_FAMILY_QWEN2_MOE = 1,
    MOEPT_FAMILY_OLMOE = 2,
    MOEPT_FAMILY_DEEPSEEK_V3 = 3
} moept_family;

typedef enum moept_activation {
    MOEPT_ACT_SILU_GATED = 0, /* down(silu(gate(x)) * up(x)): all four families */
    MOEPT_ACT_GELU_GATED = 1, /* down(gelu(gate(x)) * up(x)), exact erf gelu */
    MOEPT_ACT_GELU = 2,       /* down(gelu(up(x))) */
    MOEPT_ACT_RELU = 3        /* down(relu(up(x))) */
} moept_activation;

typedef enum moept_aux_loss {
    MOEPT_AUX_NONE = 0,
    MOEPT_AUX_HF = 1,
    MOEPT_AUX_MEGATRON = 2,
    MOEPT_AUX_SEQ = 3 /* per sequence of config.aux_seq_len tokens (see LOSSES) */
} moept_aux_loss;

typedef enum moept_shared_gate {
    MOEPT_SHARED_GATE_DEFAULT = 0, /* sigmoid for qwen2_moe, none otherwise */
    MOEPT_SHARED_GATE_NONE = 1,
    MOEPT_SHARED_GATE_SIGMOID = 2
} moept_shared_gate;

/* deepseek_v3's group-limited routing: the value the experts of the groups
   not kept take before the top-k (see ROUTING) */
typedef enum moept_group_fill {
    MOEPT_GROUP_FILL_NEG_INF = 0, /* -inf: never chosen (DeepSeek's reference, transformers >= 5.6) */
    MOEPT_GROUP_FILL_ZERO = 1     /* 0.0: chosen over a kept expert whose biased score is
                                     negative (transformers <= 5.5, DeepSeek-V3's first
                                     modeling_deepseek.py) */
} moept_group_fill;

/* Zero means "default" where a default is stated. */
#define MOEPT_MAX_CHUNKS 64
#define MOEPT_MAX_INFLIGHT 64

/* How the experts are spread over the `ep` group's ranks.
   EP: rank r owns E/P whole experts; token rows travel to them.
   FSDP: the baseline without expert parallelism: every rank keeps 1/P of
   every expert's weights (a flat shard), all-gathers the full experts
   before use, computes its own tokens locally and reduce-scatters the
   expert gradients, so each rank ends with the summed gradient of its shard. */
typedef enum moept_sharding {
    MOEPT_SHARD_EP = 0,
    MOEPT_SHARD_FSDP = 1
} moept_sharding;

enum { MOEPT_NORM_DEFAULT = 0, MOEPT_NORM_ON = 1, MOEPT_NORM_OFF = -1 }; /* norm_topk_prob */

typedef struct moept_config {
    moept_family family;
    int64_t hidden_size;              /* D, required */
    int64_t intermediate_size;        /* F, routed expert FFN width, required */
    int64_t num_experts;              /* E, required, <= 65536 */
    int64_t top_k;                    /* K, 1..E, required */
    int norm_topk_prob;               /* renormalise the K weights: MOEPT_NORM_ON,
                                         MOEPT_NORM_OFF, or 0 (MOEPT_NORM_DEFAULT):
                                         the family's (FAMILY DEFAULTS above) */
    moept_activation activation;      /* default gated SiLU */
    int64_t shared_intermediate_size; /* S, 0 = no shared expert */
    moept_shared_gate shared_gate;
    int64_t n_group, topk_group;      /* deepseek_v3 groups; 0 = 1 (off) */
    float routed_scaling_factor;      /* deepseek_v3; 0 = 1.0 */
    moept_aux_loss aux_loss;
    float aux_loss_coef;
    moept_group_fill group_fill;      /* deepseek_v3 with n_group > 1: the excluded groups'
                                         fill, default -inf (ROUTING) */
    int64_t aux_seq_len;              /* MOEPT_AUX_SEQ: tokens per sequence, S, in
                                         1..max_tokens (each forward's T a multiple
                                         of it); 0 otherwise */
    float z_loss_coef;
    float capacity_factor;            /* 0 = dropless; else per-expert capacity
                                         ceil(cf * T * K / E) (at most T * K: any
                                         finite cf), drop by position (per rank,
                                         from its own T; T counts the unmasked
                                         tokens: padding changes nothing) */
    int64_t max_tokens;               /* most rows per forward (per rank); required */
    int global_balance;               /* 0: aux and z loss over this rank's
                                         tokens; 1: over every rank's tokens
                                         (counts, score sums and T all-reduced
                                         over the EP and DP groups) */
    int64_t overlap_chunks;           /* 0 or 1: off. C > 1 (up to MOEPT_MAX_CHUNKS):
                                         each step's tokens move and compute in C
                                         chunks, one chunk's exchange in flight while
                                         the experts work on another; results are
                                         bitwise equal to C = 1 (builtin GEMM; CUDA:
                                         cuBLAS may round other row counts apart);
                                         the CUDA executor chunks only at EP > 1 */
    moept_sharding expert_sharding;   /* MOEPT_SHARD_EP (default) or MOEPT_SHARD_FSDP
                                         (CPU layers) */
    float router_jitter;              /* eps >= 0 (0 = off): a training forward's router
                                         sees x * u, u uniform in [1 - eps, 1 + eps) per
                                         element (Switch/Megatron input jitter; see ROUTER
                                         JITTER); the experts see x */
    uint64_t jitter_seed;             /* the noise's seed (ranks alike: same noise) */
    int inference_only;               /* 1: a layer for inference (see INFERENCE
                                         LAYERS): every forward an evaluation, no
                                         gradients, less memory */
    int grad_backup;                  /* 1: a backward that fails after its gradients
                                         began to accumulate (a dx overflow) restores
                                         them exactly from a copy taken at its start:
                                         one more gradient buffer, one copy per
                                         accumulating backward. 0: they are refused
                                         until moept_zero_grad (see NUMERICS). CPU
                                         layers */
    int64_t max_inflight;             /* training forwards saved at once (FORWARD SLOTS):
                                         0 or 1: one (slot 0), up to MOEPT_MAX_INFLIGHT */
    moept_fp8 fp8;                    /* MOEPT_FP8_BLOCKWISE: the expert GEMMs' operands
                                         quantized to E4M3 (FP8 TRAINING); not with
                                         FSDP sharding */
} moept_config;

/* ---- communication -------------------------------------------------
   A small table of collectives over a group of ranks. Built in: single
   rank (NULL), threads in one process (moept_comm_threads), MPI
   (moept_comm_mpi, with -DMOEPT_MPI), NCCL and threads on one GPU (CUDA
   builds: moept_comm_nccl, moept_comm_cuda_threads). A host framework
   can fill in its own, or hand its plain collectives to
   moept_comm_custom. Counts and offsets are in elements. Every call is
   collective: all ranks of the group make it, in the same order. */
typedef struct moept_seg {
    int64_t offset, count;     /* elements */
} moept_seg;

typedef struct moept_p2p {
    int peer;
    void *buf;                 /* const for sends */
    int64_t bytes;
} moept_p2p;

#define MOEPT_COMM_SLOTS 4
typedef struct moept_comm moept_comm;
struct moept_comm {
    int rank, size;
    void *ctx;                 /* backend state */
    /* All-to-all-v in pieces: for each peer q, this rank sends the nseg
       pieces send_segs[q*nseg + s] of `send` and receives from q the pieces
       recv_segs[q*nseg + s] of `recv`. Piece s from p to q has the same count
       in p's send_segs and q's recv_segs (the caller exchanged counts first).
       elem_size is 2, 4 or 8. With nseg = 1 this is MPI_Alltoallv. */
    moept_status (*alltoallv)(moept_comm *c, const void *send, const moept_seg *send_segs,
                              void *recv, const moept_seg *recv_segs, int nseg, int elem_size);
    /* In-place sum over ranks; dtype F32, F64 or I64. */
    moept_status (*allreduce)(moept_comm *c, void *buf, int64_t count, moept_dtype dtype);
    /* recv[r*bytes .. (r+1)*bytes) = rank r's send. */
    moept_status (*allgather)(moept_comm *c, const void *send, void *recv, int64_t bytes);
    /* Point-to-point, all at once: messages between two ranks match in list
       order. Used by resharding. */
    moept_status (*p2p)(moept_comm *c, const moept_p2p *sends, int nsend,
                        const moept_p2p *recvs, int nrecv);
    /* Optional non-blocking all-to-all-v (NULL: the layer's chunked
       overlap uses the blocking one): starts an exchange under `slot`
       (0..MOEPT_COMM_SLOTS-1), wait(slot) completes it. Every rank posts and
       waits the same slots in the same order; buffers and segment arrays
       stay untouched until the wait. progress (optional, may be NULL) lets a
       backend move data while the caller computes. */
    moept_status (*ialltoallv)(moept_comm *c, const void *send, const moept_seg *send_segs,
                               void *recv, const moept_seg *recv_segs, int nseg, int elem_size,
                               int slot);
    moept_status (*wait)(moept_comm *c, int slot);
    void (*progress)(moept_comm *c);
    /* Optional: waits for all ranks. */
    moept_status (*barrier)(moept_comm *c);
    /* Optional (NULL: the layer exchanges rows by message), with barrier:
       memory every rank reads and writes. shm_alloc is collective: each
       rank asks for `bytes` (they may differ) and gets all[r], rank r's
       block as mapped in this process (all[rank] its own, 64-byte
       aligned), and a handle for shm_free, which is local. It fails on
       every rank or on none. The layer keeps its experts' rows there:
       token ranks write their rows straight into the experts' rows and
       read the outputs where they lie, so every row crosses once and
       nothing is staged. Threads: the heap; MPI: anonymous memory files
       (memfd_create, opened by the peers through /proc/<pid>/fd: no name,
       so nothing is ever left in /dev/shm) when every rank runs on one
       host (Linux). A caller may set it to NULL
       before creating a layer to force the message path. */
    moept_status (*shm_alloc)(moept_comm *c, int64_t bytes, void **all, void **handle);
    void (*shm_free)(moept_comm *c, void *handle);
    void (*destroy)(moept_comm *c);
    /* Optional (NULL: the layer copies the rows into a send buffer first):
       alltoallv whose send buffer is virtual: its row r (row_elems
       elements) is row rows[r] of `base`, and send_segs count elements of
       it, as alltoallv's do. The one-chunk forward dispatch sends token rows
       straight from x with it (MPI: derived datatypes, no staging permute,
       and no permuted-input buffer: N x D floats less a rank). */
    moept_status (*alltoallv_rows)(moept_comm *c, const void *base, const int64_t *rows, int64_t row_elems,
                                   const moept_seg *send_segs, void *recv, const moept_seg *recv_segs,
                                   int nseg, int elem_size);
    char err[256];             /* backend message of the last failure */
};

/* Threads: `size` ranks in one process. Create the group once, then hand
   each rank's thread its comm (moept_comm_threads). A rank that waits
   longer than timeout_ms (0 = 600 s) for the others fails with
   MOEPT_ERR_COMM instead of hanging, naming the ranks that did not come;
   two threads arriving at one collective as the same rank fail it. Either
   breaks the group: its later collectives fail at once, with that message. */
typedef struct moept_thread_group moept_thread_group;
moept_status moept_thread_group_create(int size, int timeout_ms, moept_thread_group **out);
void moept_thread_group_destroy(moept_thread_group *g);
moept_status moept_comm_threads(moept_thread_group *g, int rank, moept_comm **out);

#ifdef MOEPT_MPI
/* Works on a duplicate of `comm` with MPI_ERRORS_RETURN; never initialises
   or finalises MPI. */
moept_status moept_comm_mpi(MPI_Comm comm, moept_comm **out);
#endif
void moept_comm_destroy(moept_comm *c);

/* A comm over the caller's own collectives: a framework's transport
   (torch.distributed, a job's existing MPI or NCCL wrapper) with moept's
   agreement and error rules on top, so the library needs no dependency of
   its own. moept packs each exchange into the plain forms below (pieces
   gathered per peer when they are not already); ops is copied, ctx is
   passed back to every op. An op returns 0, or nonzero for a failure: the
   moept call then fails with MOEPT_ERR_COMM naming the op, and the ops are
   expected to fail (or time out) alike on the peers (moept agrees before it
   acts, so one rank's refusal is every rank's; a transport that hangs on a
   lost peer hangs moept with it). Buffers are host memory. */
typedef struct moept_comm_ops {
    /* all-to-all-v of packed bytes: send holds send_bytes[0] bytes for peer 0,
       then send_bytes[1] for peer 1, ...; recv likewise by recv_bytes [size]
       (torch.distributed's all_to_all_single with split sizes) */
    int (*alltoallv)(void *ctx, const void *send, const int64_t *send_bytes, void *recv,
                     const int64_t *recv_bytes);
    int (*allreduce)(void *ctx, void *buf, int64_t count, moept_dtype dtype); /* sum in place:
                                                                   F32, F64 or I64 */
    int (*allgather)(void *ctx, const void *send, void *recv, int64_t bytes); /* recv [size][bytes] */
    /* all the listed sends and receives (moept_p2p), matched between two
       ranks in list order; NULL: resharding is refused */
    int (*p2p)(void *ctx, const moept_p2p *sends, int nsend, const moept_p2p *recvs, int nrecv);
    int (*barrier)(void *ctx); /* optional (NULL) */
} moept_comm_ops;
/* rank in [0, size); alltoallv, allreduce and allgather are required.
   Destroy with moept_comm_destroy (which calls no op). */
moept_status moept_comm_custom(const moept_comm_ops *ops, void *ctx, int rank, int size, moept_comm **out);

/* ---- CUDA ------------------------------------------------------------
   A layer on a GPU (build with MOEPT_CUDA; without it moept_create_cuda
   fails with MOEPT_ERR_UNSUPPORTED and moept_cuda_device_count is 0; with
   it but no device, with MOEPT_ERR_DEVICE: a caller can fall back to
   moept_create by status).
   What the CUDA executor does not run it refuses on every rank with
   MOEPT_ERR_UNSUPPORTED, "<call>: <feature> is not supported by the CUDA
   executor": at create grad_backup and expert_sharding =
   MOEPT_SHARD_FSDP (docs/CUDA.md, "What it does not run", says why).
   Everything else a CPU layer does, a CUDA layer does. Its comms are NCCL comms
   (moept_comm_nccl) or, for ranks that are threads on one device,
   moept_comm_cuda_threads; a host comm is refused at create.
   A layer lives on the device current at its create, and each call makes
   that device current for its duration (the caller's is restored), so any
   thread may call it; its NCCL comms must be on the same device. A kernel
   fault (an illegal address...) loses the device's CUDA context for good:
   the call that sees it, and every later call that needs the device, fails
   with MOEPT_ERR_DEVICE and says so, reading a parameter too (the device
   was its one home: a checkpoint is the way back); destroy the layer and
   its comms (only a new process can use the device again).
   Its moept_forward / moept_backward take DEVICE pointers x, y, dy, dx of
   options.dtype (F32, or BF16 passed as float* casts); the router, its
   logits, the losses, accumulation, master weights and gradients stay
   fp32. Work is queued on options.stream; the EP exchange runs on the NCCL
   comm's stream, joined by events. Host synchronisations: one per forward
   (reading the exchanged expert counts, which size everything after), and
   one per backward for the dy check, the forward's y check and the call's
   agreement, unless unchecked_backward is set.
   Parameters: the layer's parameters, gradients and AdamW moments live on
   the device alone (the host keeps the correction bias and the placement,
   E values each). moept_set_param / moept_get_param / moept_get_grad and
   moept_buf_read / moept_buf_write copy between them and host arrays, at
   once (a host sync); moept_params / moept_grads, whose pointers would be
   host memory, refuse. moept_cuda_params returns the device buffers for an
   optimizer that stays on the GPU (call moept_cuda_params_changed after it
   writes). A save copies what it writes to the host while it runs (the
   writer's buffers), a load stages what it reads there before copying it
   over; between calls the host holds no parameter-sized memory.
   moept_adamw_step and moept_grad_norm run on the device, where the
   gradients are: nothing crosses to the host but the norm's block sums,
   and the step equals a CPU layer's bitwise. adamw_step keeps grad_norm's finding
   that the same gradients are finite, so after a norm it does not wait on
   the host (a sync-free layer's may change in a replayed graph: it scans).
   A bf16 layer's weight copy is written by the AdamW step's own pass;
   after other changes (a write, moept_cuda_params,
   moept_cuda_params_changed) it is cast at the next forward, in the
   sync-free mode at once. The correction bias has its one home on the host
   (moept_update_bias or moept_set_param of it copies its E floats to the
   device, not the parameters).

   SYNC-FREE MODE (options.sync_free = 1; off by default)
     Forward and backward never wait on the host, so the host runs ahead
     and a step's work can be queued in one go (DeepEP's low-latency mode
     makes the same trade). Shapes are static: every rank sends each expert
     a block of B rows, B = the capacity at max_tokens
     (ceil(capacity_factor max_tokens K / E)) or, dropless, max_tokens (an
     expert gets a token once at most); the blocks' unused rows are zeros.
     So the receive buffers hold E B rows a rank (moept_stats.recv_capacity,
     printed by tools/plan), the exchanges move whole blocks and the expert
     GEMMs run over them: the cost of not knowing the counts, E / K times
     the routed rows when dropless, about 1 with a capacity factor near 1.
     Results are those of the default mode (the padding rows are zeros and
     add nothing).
     What the default mode checks before acting is checked on the device and
     reported later: non-finite x, router logits, losses, y or dy, a rank
     that rejected its arguments, ranks whose call sequences differ. The
     step runs to the end on every rank (no one waits in a collective a
     peer skipped), its gradients are marked, and the next moept_adamw_step
     or moept_grad_norm fails on every rank with MOEPT_ERR_NUMERIC or
     MOEPT_ERR_STATE and the reason, until moept_zero_grad. A rank's own
     argument errors (T, NULL pointers) still fail its call at once; the
     forward's peers see them through the device flag; in the backward,
     as with unchecked_backward, the peers' exchange then ends at the NCCL
     timeout. The step's statistics that need device values (losses,
     routed and dropped rows, rows sent and received, per-expert counts)
     are read when asked for (moept_get_stats, moept_get_peer_rows,
     moept_update_bias: a host sync there). A host write of the parameters
     (moept_set_param, a load) is uploaded by the next forward, which then
     waits once; moept_adamw_step (on the device, as above) or an optimizer
     of the caller's on moept_cuda_params keeps every step free of host
     syncs. Not with
     overlap_chunks > 1 (MOEPT_ERR_UNSUPPORTED at create).
     A step (moept_forward + moept_backward) can be captured in a CUDA graph
     on options.stream (not the legacy default stream): call
     moept_cuda_params first (pending host writes are uploaded then); a
     replay reruns the captured device work on the same buffers (with
     router_jitter, on the captured call's noise); after
     replays call moept_cuda_params_changed before reading gradients on the
     host (the library's host view is the captured call's). A process that
     drives several GPUs from several threads captures each rank's step on
     its own thread with cudaStreamCaptureModeThreadLocal: a global-mode
     capture is process-wide, and another thread's allocation, free or
     synchronous copy during it invalidates it. The step makes no such call
     on the capturing thread, once every forward slot it uses (and a
     training layer's evaluation slot) has run a forward: a slot's first
     forward allocates its buffers, so under a capture it is refused
     (MOEPT_ERR_STATE, the capture left valid) instead.
   gemm_form: how a call of several local experts' GEMMs reaches cuBLAS;
   every form gives the same results up to cuBLAS's own rounding.
     MOEPT_GEMM_AUTO (0, the default): one cublasGemmStridedBatchedEx where
       every expert's GEMM has one shape at constant strides (the sync-free
       mode's equal blocks), else one cublasGemmGroupedBatchedEx where the
       experts' GEMMs are small (mean m*n*k at most 1e9, where it won on an
       H200: docs/CUDA.md) and its documented types and pointer alignment
       allow (CUDA >= 12.5), else one cublasGemmEx an expert over side streams.
     MOEPT_GEMM_GROUPED: the grouped call wherever it applies, equal groups
       too (else per expert; MOEPT_ERR_UNSUPPORTED at create below CUDA 12.5).
     MOEPT_GEMM_PER_EXPERT: one cublasGemmEx an expert, over up to 4 side
       streams (each with its own cuBLAS handle and workspace).
     MOEPT_GEMM_STRIDED: the strided-batched call where the groups are equal,
       else per expert over side streams (never the grouped call).
     MOEPT_GEMM_KERNEL: moept's own grouped GEMM for Hopper (one launch over
       every local expert, TMA loads and wgmma, docs/CUDA.md) for every bf16
       expert GEMM (forward, dgrad and wgrad, the gated activation and its
       backward in their epilogues), at any widths; at one rank the routed
       experts read x through the dispatch's row index (no permuted copy);
       in the sync-free mode it skips the blocks' zero rows by the counts on
       the device; with config.fp8 every expert GEMM in E4M3 (wgmma, the
       scales promoted every 128 of K).
       AUTO's choice elsewhere (fp32 layers). Refused
       at create (MOEPT_ERR_UNSUPPORTED) on a GPU other than compute
       capability 9.0 or a build without sm_90a code (nvcc -gencode
       arch=compute_90a,code=sm_90a). AUTO does not pick it yet: it has not
       been timed on a GPU.
   bf16 weight gradients (bf16 A and B, fp32 C) are outside the grouped
   call's table: per expert in every form but where the groups are equal
   (strided, in AUTO and STRIDED). docs/CUDA.md has the side streams' cost. */
typedef enum moept_gemm_form {
    MOEPT_GEMM_AUTO = 0,
    MOEPT_GEMM_GROUPED = 1,
    MOEPT_GEMM_PER_EXPERT = 2,
    MOEPT_GEMM_STRIDED = 3,
    MOEPT_GEMM_KERNEL = 4
} moept_gemm_form;
typedef struct moept_cuda_options {
    moept_dtype dtype;          /* F32 (default) or BF16 token rows and expert weights */
    void *stream;               /* cudaStream_t for compute; NULL = default stream */
    int unchecked_backward;     /* 1: skip the backward's dy and y checks, its agreement
                                   and its host sync */
    int sync_free;              /* 1: no host sync in forward and backward (above) */
    moept_gemm_form gemm_form;  /* the expert GEMMs' cuBLAS calls (above); 0: AUTO */
} moept_cuda_options;
int moept_cuda_device_count(void);
moept_status moept_create_cuda(const moept_config *cfg, moept_comm *ep, moept_comm *dp,
                               const moept_cuda_options *opt, moept_layer **out);
/* Device parameter and gradient buffers (layout of moept_params), fp32;
   grads is NULL in an inference layer (config.inference_only). */
moept_status moept_cuda_params(moept_layer *layer, float **params, float **grads, int64_t *numel);
moept_status moept_cuda_params_changed(moept_layer *layer);
#ifdef MOEPT_CUDA
/* NCCL: collectives on `stream` (a cudaStream_t). Buffers may be device or
   host memory (host buffers cross through the comm's pinned and device
   staging, and the call polls for the result with the timeout). With a
   non-blocking communicator (ncclConfig_t blocking = 0) every call polls
   ncclCommGetAsyncError and aborts the communicator after timeout_ms
   (0 = 600 s) instead of hanging; a blocking one may block inside NCCL
   while it connects to a peer. Never initialises NCCL.
   An asynchronous NCCL error or a timeout (a peer that never came) makes
   moept call ncclCommAbort, the one way to end the stuck NCCL kernels; the
   call fails with MOEPT_ERR_COMM, and every later call on this moept_comm
   fails at once without touching the handle. ncclCommAbort frees the
   communicator: when moept_comm_nccl_aborted(c) is 1, the owner must not
   call ncclCommDestroy on it (a double free); moept_comm_destroy(c) is still
   needed. The layers' parameters stay readable. Each call
   makes the communicator's device (ncclCommCuDevice) current for its
   duration. */
moept_status moept_comm_nccl(ncclComm_t comm, void *stream, int timeout_ms, moept_comm **out);
int moept_comm_nccl_aborted(const moept_comm *c);
/* Ranks that are threads of one process on one GPU, without NCCL (expert
   parallelism on one device: debugging, tests, a workstation): each rank's
   thread makes its comm from the same thread group (moept_thread_group_create)
   on the device current at the call, its collectives on its `stream`. Rows
   move by cudaMemcpyAsync between the ranks' buffers (each rank copies its
   peers' bytes to it), ordered by events; sums run in rank order (the same
   bits on every rank). Device-buffer calls are asynchronous on `stream` as
   NCCL's are (p2p waits); host buffers go through the thread group once the
   stream has drained. A stream that does not drain within timeout_ms (0 =
   600 s; < 0 is MOEPT_ERR_INVALID_ARGUMENT, as for moept_comm_nccl) is an
   error. The group's comm of `rank` (moept_comm_threads)
   carries the rendezvous: other calls on it are collectives in the same
   order too. moept_comm_destroy of this comm is collective too (a barrier
   of the group: a peer may still wait on its events); the group stays the
   caller's. Misuse fails every rank, the message naming it, and moves no
   data: a rank whose comm another thread holds is refused at create
   (MOEPT_ERR_INVALID_ARGUMENT, "rank N claimed twice") and breaks the
   group, so the others' create or next call fails (MOEPT_ERR_COMM); a rank
   that does not come fails its peers' call at the group's timeout
   (MOEPT_ERR_COMM, naming it); host buffers on one rank and device buffers
   on another in one call are refused on every rank
   (MOEPT_ERR_INVALID_ARGUMENT; each rank passes buffers of one kind); a
   destroy while a peer is in a call fails that call (MOEPT_ERR_COMM) and
   breaks the group, freeing nothing a peer may still use; a call in a CUDA
   graph capture is refused (MOEPT_ERR_UNSUPPORTED: a replay would skip the
   rendezvous). */
moept_status moept_comm_cuda_threads(moept_thread_group *g, int rank, void *stream, int timeout_ms,
                                     moept_comm **out);
#endif

/* The memory a layer holds now, by kind (moept_stats.host_bytes and
   device_bytes): every byte of its own buffers on that side is in exactly
   one kind, so a side's kinds sum to all it holds (tests/test_alloc.c checks
   the sums against the allocator's and the emulated GPU's live bytes; the
   transient buffers of a call are freed before it returns). n is
   moept_param_numel, npad n rounded up to 64.
     PARAMS     the fp32 parameters and the correction bias [E]. CPU layer:
                4 (n + E) on the host. CUDA layer: the device's parameter
                block, 4 npad + 8 E + 256 (the bias and the placement
                beside the parameters, the alignment); the host keeps the
                bias alone, 4 E.
     GRADS      the fp32 gradients (none in an inference layer), with
                config.grad_backup's second copy on the CPU: 4 n (8 n),
                on the device 4 npad.
     MOMENTS    AdamW's m and v, from the first moept_adamw_step (or a
                load of a checkpoint that has them): 8 n on the CPU, 8 npad
                on the device.
     CASTS      lower-precision copies of the weights, made from the fp32
                masters: a bf16 CUDA layer's bf16 copy of every weight but
                the router's (2 bytes each); config.fp8's quantized weights
                (the CPU layer's dequantized fp32 copy of the experts',
                4 bytes each; the CUDA layer's E4M3 copies of W13 and W2
                and their transposes, with their scales).
     WORKSPACE  the rest: every forward slot's routing, plan, activations
                and exchange rows, the receive rows (moept_stats.recv_capacity),
                the GEMM scratch (the builtin GEMM's packing, cuBLAS's
                workspaces, FP8's token operands), FSDP's gathered experts
                and their gradients, and the layer's bookkeeping (its
                struct, parameter table; a CUDA layer's executor's host
                blocks, pinned ones included).
   docs/PLAN.md models each kind from the config (tools/plan.c). */
typedef enum moept_mem_kind {
    MOEPT_MEM_PARAMS = 0,
    MOEPT_MEM_GRADS = 1,
    MOEPT_MEM_MOMENTS = 2,
    MOEPT_MEM_CASTS = 3,
    MOEPT_MEM_WORKSPACE = 4,
    MOEPT_MEM_NKINDS = 5
} moept_mem_kind;

typedef struct moept_stats {
    int64_t steps;             /* successful forwards since create */
    int64_t tokens;            /* T of the last forward */
    int64_t routed_rows;       /* token-expert assignments computed */
    int64_t dropped_rows;      /* assignments dropped by capacity */
    int64_t masked_tokens;     /* padding tokens of the last forward (routed nowhere) */
    int64_t capacity;          /* per-expert capacity, -1 if dropless */
    float aux_loss;            /* unscaled values of the last forward */
    float z_loss;
    int64_t allocations;       /* allocations of the layer's own buffers since create
                                  (not the transient buffers of a load or save,
                                  freed before the call returns) */
    int64_t allocated_bytes;   /* bytes allocated since create */
    int64_t workspace_bytes;   /* host bytes held now in the workspace blocks: the layer's,
                                  each forward slot's, the receive and shared rows (a part of
                                  host_bytes' CASTS + WORKSPACE) */
    int64_t param_bytes;       /* parameters + gradients (+ config.grad_backup's copy) on the
                                  host: host_bytes' PARAMS + GRADS */
    /* expert parallel, last forward + backward on this rank */
    int64_t rows_sent, rows_received;   /* token rows to/from other ranks, per direction */
    int64_t bytes_sent, bytes_received; /* all exchanges of the step (dispatch,
                                           combine, and their backward) */
    double comm_seconds;       /* wall time inside communication calls */
    double dispatch_seconds;   /* permute + exchange to the experts, forward and
                                  backward (dys out, dxs back + token sums) */
    double combine_seconds;    /* exchange back + weighted sums (forward), and
                                  dL/dw + dys scaling (backward) */
    int64_t recv_capacity;     /* rows the receive buffers hold now */
    int64_t recv_growths;      /* times they grew (each an allocation) */
    int64_t checkpoint_bytes_read; /* by moept_load_hf since create */
    int64_t device_workspace_bytes; /* CUDA layers: device memory held beyond the
                                       parameters and gradients: device_bytes' MOMENTS +
                                       CASTS + WORKSPACE (allocations above count both sides) */
    int64_t shared_exchange;   /* 1: the expert exchange writes and reads the experts'
                                  rows in shared memory (the EP comm's shm_alloc);
                                  0: by message, or one rank */
    int64_t host_bytes[MOEPT_MEM_NKINDS];   /* bytes held now, by moept_mem_kind: host memory */
    int64_t device_bytes[MOEPT_MEM_NKINDS]; /* device memory (CUDA layers; zeros on the CPU) */
} moept_stats;

/* Rows this rank sent to / received from each EP peer in the last forward's
   dispatch ([P] each; either may be NULL). */
moept_status moept_get_peer_rows(const moept_layer *layer, int64_t *sent, int64_t *received);


typedef struct moept_param_info {
    const char *name;  /* HF module-relative name; valid while the layer lives */
    int64_t rows, cols; /* shape [rows][cols]; a vector has rows = 1 */
    float *data;       /* inside the parameter buffer (NULL for none, and in a
                          CUDA layer, whose buffers live on its device; the
                          correction bias: its host home, always) */
    float *grad;       /* mirror in the gradient buffer; NULL without gradient,
                          and in a CUDA layer (moept_get_grad names those
                          without: MOEPT_ERR_NOT_FOUND) */
    int64_t shard_offset; /* fsdp expert tensors: offset in the full expert space
                             (data and grad NULL); -1 otherwise */
    int64_t offset;    /* first element's index in the buffer moept_buf_read
                          reads (-1: the correction bias, and fsdp's expert
                          tensors, outside it) */
} moept_param_info;

/* A config with `family` set and every other field zero (each zero takes
   the family's default): an initialiser that C and C++ both accept
   (`= {0}` is an error in C++, whose first member is an enum). */
moept_config moept_config_default(moept_family family);
/* A Hugging Face model's config.json (path: the file, or the checkpoint
   directory holding it) -> cfg, for decoder layer `layer`: family, sizes,
   experts, top-k, norm_topk_prob, activation, shared width (deepseek_v3:
   n_shared_experts * moe_intermediate_size), n_group, topk_group,
   routed_scaling_factor, group_fill (MOEPT_GROUP_FILL_NEG_INF, DeepSeek's
   reference: config.json has no key for it; for the routing of
   transformers <= 5.5 set MOEPT_GROUP_FILL_ZERO after this call), and the
   aux loss (MOEPT_AUX_HF with router_aux_loss_coef; none for
   deepseek_v3: see AUX AGAINST TRANSFORMERS below). model_type mixtral,
   qwen2_moe, qwen3_moe (as qwen2_moe without a shared expert), olmoe,
   deepseek_v3. A dense layer (qwen: decoder_sparse_step, mlp_only_layers;
   deepseek: first_k_dense_replace, moe_layer_freq) is
   MOEPT_ERR_INVALID_ARGUMENT. moe_layer_freq is applied as DeepSeek's own
   modeling code does (a layer from first_k_dense_replace on is MoE when
   layer % moe_layer_freq == 0); transformers' DeepseekV3 ignores the key
   (every layer from first_k_dense_replace on is MoE). The published
   checkpoints have moe_layer_freq 1, where both agree; a checkpoint with
   another value comes from DeepSeek's code, whose other layers are dense
   and hold no experts to load. An unknown model_type, a missing size key
   or a contradictory one is an error naming the key. Absent non-size keys
   take transformers' class defaults. router_jitter_noise (mixtral) is
   read into router_jitter (ROUTER JITTER above: how transformers' jitter
   differs); output_router_logits is not read (AUX AGAINST TRANSFORMERS).
   max_tokens, z_loss_coef,
   capacity_factor, global_balance, overlap_chunks and expert_sharding
   stay as cfg had them;
   on failure cfg is unchanged. routed_scaling_factor must be > 0 (0,
   which this struct reads as 1.0, is refused). The file is read as
   RFC 8259 JSON, as strictly as model.safetensors.index.json and a
   training checkpoint's index.json: invalid UTF-8, trailing content,
   leading zeros, malformed literals (anywhere, also in keys moept does not
   read), NaN/Infinity and U+0000 in a string are MOEPT_ERR_FORMAT, and so
   is a key twice in one object, at any depth (Python's json, and so
   transformers, takes the last value; taking the first would route
   differently without a word): the message names the key.

   AUX AGAINST TRANSFORMERS. transformers adds router_aux_loss_coef times
   load_balancing_loss_func once per model, over every layer's router
   logits concatenated, and only when output_router_logits is true.
   moept's MOEPT_AUX_HF is that function over one layer, and the reader
   turns it on at router_aux_loss_coef in every layer, whatever
   output_router_logits says. So, summed over L MoE layers, moept's aux
   weighs about L times transformers' (exactly L times when every layer
   routes alike; the layers' covariance of counts and probabilities is
   the rest). To match transformers: output_router_logits false, set
   aux_loss = MOEPT_AUX_NONE; true, set aux_loss_coef to
   router_aux_loss_coef / L (equal up to that covariance term). */
moept_status moept_config_from_hf(const char *path, int64_t layer, moept_config *cfg);

/* Lifecycle */
moept_status moept_create(const moept_config *cfg, moept_layer **out);
/* Expert parallel: experts are sharded over the `ep` group (rank r owns the
   E/P experts [r*E/P, (r+1)*E/P)); router and shared expert are replicated.
   `dp` (may be NULL) joins the ranks that hold the same experts in other EP
   groups (world = EP x DP). Every rank of both groups calls this together;
   a config that differs between ranks is an error on every rank naming the
   field, except max_tokens: each rank's own bound on its rows (ranks may
   hold batches of different sizes; a sync-free CUDA layer sizes its blocks
   from the largest). The EP and DP groups must be two axes of one EP x DP
   grid: one comm passed as both, a DP peer that is also in this rank's EP
   group, or a DP group joining ranks of different EP ranks (so holding
   other experts) is MOEPT_ERR_INVALID_ARGUMENT on every rank, the message
   naming it (each rank draws an id; both groups gather them). The comms
   must outlive the layer. */
moept_status moept_create_parallel(const moept_config *cfg, moept_comm *ep,
                                   moept_comm *dp, moept_layer **out);
void moept_destroy(moept_layer *layer);
/* Fills `cfg` with the resolved configuration (defaults applied). */
moept_status moept_get_config(const moept_layer *layer, moept_config *cfg);
/* fsdp (config.expert_sharding): this rank's flat range [offset, offset +
   count) of the full expert space (w13 of all experts [E][H][D], then w2
   [E][D][F]; total floats) and where it sits in moept_params / moept_grads:
   right after the router weight (E * D floats). The shard is padded to
   ceil(total / P) floats; padding stays zero. */
moept_status moept_fsdp_shard(const moept_layer *layer, int64_t *offset, int64_t *count, int64_t *total);

/* Parameters by HF name. `numel` must equal rows*cols of the parameter. */
moept_status moept_set_param(moept_layer *layer, const char *name,
                             const float *src, int64_t numel);
moept_status moept_get_param(const moept_layer *layer, const char *name,
                             float *dst, int64_t numel);
moept_status moept_get_grad(const moept_layer *layer, const char *name,
                            float *dst, int64_t numel);
/* Enumerate: index 0..moept_param_count()-1, in buffer order. */
int64_t moept_param_count(const moept_layer *layer);
moept_status moept_param_info_at(const moept_layer *layer, int64_t index,
                                 moept_param_info *info);
/* The one contiguous parameter buffer and its gradient mirror (same layout).
   The correction bias is not in it (moept_set_param/get_param reach it).
   A CUDA layer's buffers live on its device only: these refuse it
   (MOEPT_ERR_UNSUPPORTED); moept_cuda_params gives the device pointers,
   moept_buf_read / moept_buf_write copy. */
moept_status moept_params(moept_layer *layer, float **params, int64_t *numel);
moept_status moept_grads(moept_layer *layer, float **grads, int64_t *numel);
/* Copies of any layer's buffers, wherever they live: elements [offset,
   offset + count) of the parameter or gradient buffer (moept_params'
   layout, moept_param_numel floats) to or from host memory. A write checks
   that every value is finite first (nothing written otherwise) and, of the
   parameters, invalidates pending backwards as moept_set_param does. */
typedef enum moept_buf { MOEPT_BUF_PARAMS = 0, MOEPT_BUF_GRADS = 1 } moept_buf;
int64_t moept_param_numel(const moept_layer *layer);
moept_status moept_buf_read(const moept_layer *layer, moept_buf which, int64_t offset, int64_t count,
                            float *dst);
moept_status moept_buf_write(moept_layer *layer, moept_buf which, int64_t offset, int64_t count,
                             const float *src);
/* Fills every parameter with deterministic random values in the ranges of
   torch.nn.Linear's default init (uniform +-1/sqrt(fan_in)). */
moept_status moept_init_params(moept_layer *layer, uint64_t seed);

/* Compute */
moept_status moept_forward(moept_layer *layer, const float *x, int64_t tokens,
                           float *y);
/* moept_forward with per-call options (a zeroed struct, or NULL, is
   moept_forward). */
typedef struct moept_forward_opts {
    const uint8_t *mask; /* [tokens] or NULL (all tokens). 0 marks padding: the
                            token is routed nowhere (moept_routing: ids -1,
                            weights 0), its y row is 0 (shared expert too, which
                            never reads a padded row of x: what it holds changes
                            nothing), no gradient flows from it (its dx row is
                            0), capacity is that of the unmasked tokens, and it is
                            left out of the aux and z losses, their token count
                            and the expert counts, as transformers'
                            load_balancing_loss_func with attention_mask (global
                            balance: summed over the ranks' unmasked tokens).
                            The backward uses the forward's mask. A CUDA
                            layer's is device memory, as x and y */
    int eval;            /* 1: an evaluation forward (PyTorch's model.eval() under
                            no_grad): no router jitter, and nothing is kept for a
                            backward. It leaves the training forwards' slots as
                            they were (their backward follows it, as if it had not
                            run; moept_update_bias, which reads the last forward,
                            refuses after it). Every rank passes the same. y is the
                            training forward's (bitwise, jitter off) */
    const int32_t *replay_ids; /* [tokens][K] or NULL: routing replay (ROUTING REPLAY
                            above): each token's K experts instead of the router's
                            choice, weighted from the current logits. CUDA layers:
                            device memory, as x */
    float *logits_out;   /* [tokens][E] fp32 or NULL: the router's logits (what the
                            router's softmax/sigmoid read; with jitter, of x*u)
                            written here, for a router loss of the caller's
                            (moept_backward_opts.dlogits). A CUDA layer's is device
                            memory. Padded rows: 0 */
    int slot;            /* a training forward's slot, 0..max_inflight-1 (FORWARD SLOTS):
                            its saved state replaces what the slot held. An
                            evaluation forward ignores it (it keeps nothing) */
} moept_forward_opts;
moept_status moept_forward_ex(moept_layer *layer, const float *x, int64_t tokens, float *y,
                              const moept_forward_opts *opts);
moept_status moept_backward(moept_layer *layer, const float *x,
                            const float *dy, float *dx);
/* moept_backward with per-call options. NULL is moept_backward.
   Gradient accumulation over N micro-batches with the main loss scaled by
   1/N (dy = dL/dy / N): pass router_loss_scale = 1/N, so moept's aux and z
   losses are averaged alike. fp16-style loss scaling (dy = S dL/dy): pass
   S, and unscale the gradients (moept_sync_grads' scale 1/S) as the rest of
   the model's. Both: their product, the factor applied to dy. Then
   backward(s dy, scale s) = s backward(dy, 1) (exactly for a power of 2).
   A router loss of the caller's (HF's load_balancing_loss_func over all
   layers' logits concatenated, a custom balance term): take each layer's
   logits with moept_forward_opts.logits_out, compute the loss and its
   gradient dL/dlogits, and pass that as dlogits (already scaled as dy is).
   Under EP every rank must pass the same router_loss_scale (agreed with
   the call; a CUDA layer in sync-free mode or with unchecked_backward does
   not agree, and does not check it); dlogits is each rank's own tokens'. */
typedef struct moept_backward_opts {
    float router_loss_scale;  /* multiplies the gradients of moept's own router losses (the aux
                                 and z terms, MOEPT_AUX_SEQ's too) before they join dy's: the
                                 factor the caller applied to its main loss (1/N of gradient
                                 accumulation, a loss scale), so the losses keep their weight.
                                 Finite. 1 in moept_backward_default() */
    const float *dlogits;     /* [T][E] fp32, or NULL: dL/dlogits of the caller's own router
                                 loss, added to moept's terms; logits as
                                 moept_forward_opts.logits_out wrote them. A CUDA layer's is
                                 device memory, as x. Padded rows (opts.mask) are not read.
                                 Not scaled by router_loss_scale. Finite (a CUDA layer's is
                                 checked on the device: the next adamw_step or grad_norm
                                 refuses the gradients, naming it) */
    int slot;                 /* the forward differentiated: the training forward saved in this
                                 slot (FORWARD SLOTS). 0 in moept_backward_default() */
} moept_backward_opts;
moept_backward_opts moept_backward_default(void); /* {1.0f, NULL, 0} */
moept_status moept_backward_ex(moept_layer *layer, const float *x, const float *dy, float *dx,
                               const moept_backward_opts *opts);
moept_status moept_zero_grad(moept_layer *layer);
/* Moves experts between the ranks of a running EP group to a new placement
   (new_rank[e]: the rank that will hold expert e; every rank gets E/P
   experts; e.g. from recent load, to balance ranks). Collective over the EP
   group, between steps; the rank count stays (to change it, save a
   checkpoint and load it at the other EP size). Each expert whose owner
   changes travels once, straight from its old owner to its new one
   (point-to-point), in rounds in which each rank sends one expert and
   receives one (or is idle), so the extra memory per rank is one expert;
   experts that stay are not touched (an arriving expert takes the place a
   leaving one freed). Parameters and AdamW state move; gradients are
   zeroed. From then on the dispatch order follows the placement. Every EP
   group of a DP layout must reshard alike. A CUDA layer moves them device
   to device over its NCCL comm and keeps a host copy of the experts it
   sends while the call runs: if any rank's moves fail (a comm error), every rank fails and
   puts its experts back, so every rank is as before the call. A CPU
   layer whose comm fails during the moves is left part-moved, and peers
   that finished keep their moves (reload a checkpoint). */
typedef struct moept_reshard_report {
    int64_t experts_moved;      /* whole group */
    int64_t bytes_sent, bytes_received; /* this rank */
    int64_t rounds;
    int64_t extra_bytes;        /* this rank's staging memory (one expert) */
} moept_reshard_report;
moept_status moept_reshard(moept_layer *layer, const int32_t *new_rank,
                           moept_reshard_report *report);
/* The current placement: rank_of[e] for every expert ([E]). */
moept_status moept_get_placement(const moept_layer *layer, int32_t *rank_of);

/* Gradient reduction across ranks: replicated parameters (router, shared
   expert) are summed over all EP x DP ranks, each expert's over the DP group
   (the ranks holding the same expert); then everything is multiplied by
   `scale`. With scale = 1 the gradients are those of the sum of every
   rank's objective, i.e. of one rank processing the whole batch (use
   global_balance for its aux loss); scale = 1/DP averages over data-parallel
   replicas as DDP does. Under EP or DP, moept_adamw_step refuses (on every
   rank) gradients a backward changed since the last sync or zero_grad. */
moept_status moept_sync_grads(moept_layer *layer, float scale);
/* For callers who sum the gradient buffer (moept_grads) over the group
   themselves: declares this rank's gradients synced, so moept_adamw_step
   takes them. Local, no communication. */
moept_status moept_grads_synced(moept_layer *layer);
/* Global L2 norm of the gradients (for clipping), each expert counted once
   and replicated parameters once. Call after moept_sync_grads. */
moept_status moept_grad_norm(moept_layer *layer, double *norm);

/* Aux-loss-free balancing (DeepSeek-V3): with the last forward's counts,
   bias_e += rate * sign(mean_count - count_e). The bias is replicated, so
   under EP/DP the counts are the whole batch's: a collective call (every
   rank makes it), unless global_balance already summed them. */
moept_status moept_update_bias(moept_layer *layer, float rate);

/* Router outputs of the last forward: ids [T][K] (int32), weights [T][K],
   logits [T][E]. Any pointer may be NULL. Valid until the next forward.
   With forward slots: the last forward call's, whatever backwards ran since.
   The layer is not const: a CUDA layer copies its routing into host
   buffers of its own here (moept_routing_grads too). */
moept_status moept_routing(moept_layer *layer, const int32_t **ids,
                           const float **weights, const float **logits);

/* After moept_backward: dL/d(routing weight) [T][K], in the order of ids.
   Valid until the next forward. */
moept_status moept_routing_grads(moept_layer *layer, const float **dweights);

/* Stats of the last successful forward; tokens_per_expert [E] may be NULL. */
moept_status moept_get_stats(const moept_layer *layer, moept_stats *stats,
                             int64_t *tokens_per_expert);

const char *moept_status_string(moept_status s);
/* The CPU GEMM this build runs: "cblas", or "builtin " and the kernel the
   target macros chose ("avx2+fma 6x16", "avx512f 12x32", "neon 8x12",
   "portable 4x8"), for logs and benchmarks. */
const char *moept_gemm_kernel(void);
/* The calling thread's last failure message, whatever call it came from
   (see CONVENTIONS); `layer` is not read (NULL is fine). Never NULL. */
const char *moept_last_error(const moept_layer *layer);

/* ---- safetensors (read side; used by the checker and checkpoints) ----- */

typedef struct moept_st_file moept_st_file;
typedef struct moept_st_tensor {
    const char *name;
    moept_dtype dtype;
    int ndim;
    int64_t shape[8];
    int64_t numel;
    int64_t offset, nbytes; /* absolute file offset of the data */
} moept_st_tensor;

/* Opens and validates the header (strict: see moept.c; zero-element tensors
   are fine). On failure *out is NULL and moept_last_error(NULL) names the
   rule broken. Every file moept reads must be a regular file: a FIFO or
   device is refused before it can block. */
moept_status moept_st_open(const char *path, moept_st_file **out);
void moept_st_close(moept_st_file *f);
int64_t moept_st_count(const moept_st_file *f);
const moept_st_tensor *moept_st_at(const moept_st_file *f, int64_t i);
const moept_st_tensor *moept_st_find(const moept_st_file *f, const char *name);
/* NULL if absent. */
const char *moept_st_meta(const moept_st_file *f, const char *key);
/* Reads a tensor, converting F32/F16/BF16/F64 to float, or I64/I32 to int64. */
moept_status moept_st_read_f32(moept_st_file *f, const moept_st_tensor *t,
                               float *dst, int64_t numel);
moept_status moept_st_read_i64(moept_st_file *f, const moept_st_tensor *t,
                               int64_t *dst, int64_t numel);

/* ---- optimizer and training checkpoints -------------------------------- */
typedef struct moept_adamw {
    float lr, beta1, beta2, eps, weight_decay; /* each as given (0 is 0); lr finite and > 0,
                                                  betas in [0,1), eps finite and > 0,
                                                  weight_decay finite and >= 0, lr*weight_decay <= 1 */
} moept_adamw;
/* torch.optim.AdamW's defaults at this lr: betas (0.9, 0.999), eps 1e-8,
   weight_decay 0.01. Set a field after it to change one:
       moept_adamw o = moept_adamw_default(3e-4f); o.weight_decay = 0.1f; */
moept_adamw moept_adamw_default(float lr);
/* One AdamW step over this rank's parameter buffer with its gradients, as
   torch.optim.AdamW: p -= lr*wd*p; m, v updated; p -= lr/(1-b1^t) * m /
   (sqrt(v)/sqrt(1-b2^t) + eps). Correct under EP once gradients are synced:
   each rank updates its own experts, replicated parameters get identical
   updates everywhere. The state (m, v, t) is allocated on the first call
   (a CUDA layer's m and v on the device, where its step runs: see CUDA).
   A non-finite gradient anywhere (on any rank of the groups) rejects the
   step with MOEPT_ERR_NUMERIC naming the parameter; nothing changes. So
   does a step that would make a moment or a parameter non-finite (a
   finite gradient too large for fp32's v = b2 v + (1-b2) g^2, say): the
   state stays one a save can write and a load can read. Checked as the
   step goes, at no extra pass in practice: bounds from the gradients' sum
   of squares settle it, and only where they cannot (gradients near fp32's
   limit, moments just loaded or resharded) the step is first computed
   without writing. A hyperparameter out of range (the opt fields' comment;
   0 lr would train nothing), or a bias-corrected step size lr/(1-b1^t)
   that overflows fp32, is refused with MOEPT_ERR_INVALID_ARGUMENT. A step
   drops nothing but makes pending forwards' backwards fail (see
   moept_backward). */
moept_status moept_adamw_step(moept_layer *layer, const moept_adamw *opt);
/* Training checkpoint in directory `dir` (created if needed), atomic as a
   set. Each rank of DP replica 0 writes rank-R-of-P.safetensors
   (parameters under HF names, AdamW state, correction bias, the step, a
   checksum per tensor) into a new set directory dir/save-<step>-<nonce>/;
   once every rank has written its file whole (agreed), rank 0 renames
   dir/index.json into place (E, the EP size, the config fingerprint, the
   step and the set's name): the one commit point. Until then the previous
   set stays current; a save killed anywhere (one rank or all) leaves the
   previous checkpoint or the new one, never a mix. After the commit rank 0
   removes the superseded sets and what killed saves left; a failed save
   removes its own set. Loading reads the set the index names (or, for
   older checkpoints without a set, dir itself), verifies all of it (each
   tensor's checksum where the file has one, finiteness, AdamW's v >= 0,
   the step of every file and of the index), agrees over the groups and
   restores the exact state, so training resumes bitwise; a
   checkpoint saved at EP size P loads into any EP size Q (P and Q dividing
   E): each rank reads only its experts' byte ranges from the files that
   hold them. One job saves into a directory at a time. A save refuses
   (MOEPT_ERR_NUMERIC, on every rank, before touching `dir`) a state with a
   non-finite parameter or moment, so the previous set survives. `dir` is a
   boundary: the library writes and removes only regular files and
   directories it made inside it, never through a symbolic link (a link
   named like a set is left alone); reads follow links. */
moept_status moept_save_checkpoint(moept_layer *layer, const char *dir);
moept_status moept_load_checkpoint(moept_layer *layer, const char *dir);

/* ---- safetensors, write side -------------------------------------------
   Tensors are added by pointer (no copy) and written in the order added.
   The file is written atomically: a temporary file in the same directory,
   fsync, rename over `path`, fsync of the directory. A crash leaves either
   the old file or the new one, never a torn one. The temporary name is
   unique per process and call, so threads (ranks, data-parallel replicas)
   may write one path at once; a killed save's temporary file is left behind
   (`path.tmp.*`), never read. */
typedef struct moept_st_writer moept_st_writer;
moept_status moept_st_writer_create(moept_st_writer **out);
void moept_st_writer_destroy(moept_st_writer *w);
moept_status moept_st_add(moept_st_writer *w, const char *name, moept_dtype dtype,
                          int ndim, const int64_t *shape, const void *data);
moept_status moept_st_add_meta(moept_st_writer *w, const char *key, const char *value);
moept_status moept_st_write(moept_st_writer *w, const char *path);

/* ---- Hugging Face checkpoints --------------------------------------------
   The MoE block of decoder layer `layer_index`, under the model's names:
   mixtral "model.layers.{L}.block_sparse_moe.", the others
   "model.layers.{L}.mlp.", followed by the names listed at the top.
   moept_load_hf reads a checkpoint directory (model.safetensors, or the
   shards listed in model.safetensors.index.json): this rank's experts and
   the replicated tensors only, by positioned reads of their byte ranges (no
   whole-file read, no concatenation); F32, BF16 and F16 convert to fp32.
   FP8 weights as DeepSeek-V3 publishes them (F8_E4M3, each with a
   "<name>_scale_inv" F32 or BF16 tensor of per-block scales, the block
   from config.json's quantization_config.weight_block_size, else 128 x
   128) are dequantised on load: element times its block's scale, one fp32
   rounding (equal to a float64 dequantisation rounded to fp32); a rank
   reads only its own experts' weights and scales. Each scale read must be
   a positive normal finite fp32 number: 0, -0, a negative, a denormal,
   NaN or Inf (a block zeroed, negated or lost) is MOEPT_ERR_NUMERIC, as a
   non-finite weight element is, naming the scale tensor and the block
   ([block row][block column]). quantization_config, read here (not by
   moept_config_from_hf): weight_block_size is honoured, any positive
   [rows, cols]; fmt must be "e4m3", quant_method "fp8" and
   activation_scheme "dynamic", DeepSeek-V3's values, which an absent
   field takes; another value is MOEPT_ERR_UNSUPPORTED naming the field.
   A field of the wrong type, or a quantization_config that is not an
   object (null: none), is MOEPT_ERR_FORMAT; its other keys are not read
   (a tensor is FP8 by its dtype). quantization_config is checked whether
   or not the checkpoint holds FP8 tensors.
   The bytes read (headers included) are counted in moept_stats. Nothing
   changes unless every tensor was found, read and passed these checks on
   every rank (a group call: one rank's refusal fails them all). */
moept_status moept_load_hf(moept_layer *layer, const char *dir, int64_t layer_index);
/* Writes this rank's experts (and, if with_replicated, the router, bias and
   shared expert) of layer `layer_index` under the HF names, as one
   safetensors file. */
moept_status moept_save_hf(moept_layer *layer, const char *path, int64_t layer_index,
                           int with_replicated);
/* The same in dtype F32, BF16 or F16 (rounded to nearest even; F16 past
   65504 is Inf), so a bf16 checkpoint round-trips at its own size; the
   deepseek_v3 correction bias stays F32. */
moept_status moept_save_hf_as(moept_layer *layer, const char *path, int64_t layer_index,
                              int with_replicated, moept_dtype dtype);

/* ---- ABI: the public structs' layout, for bindings ------------------------
   A binding that mirrors these structs (Python's ctypes, a Rust or Julia
   FFI) checks its mirror against the library it loaded before any other
   call: moept_abi_layout writes, into buf (cap bytes, NUL-terminated,
   truncated if short), the layout the library was compiled with, and
   returns the length of the whole text (as snprintf: call with cap 0 for
   the size). One item a line:
       abi 1                         MOEPT_ABI_VERSION
       struct moept_config 160       sizeof
       field moept_config.family 0 4 offsetof, sizeof (every field, in
                                     declaration order)
   The version changes when a struct's meaning changes without its layout
   changing; a new field or struct changes the layout the lines show (a
   mirror that checks every line it knows, and that every field of its
   structs is listed, sees it). examples/hf_swap.py does this. */
#define MOEPT_ABI_VERSION 1
int64_t moept_abi_layout(char *buf, int64_t cap);
/* The structs and fields reported, in declaration order: S(struct) then
   F(struct, field) for each field (a new field or struct: one line here) */
#define MOEPT_ABI_STRUCTS(S, F) \
    S(moept_config) F(moept_config, family) F(moept_config, hidden_size) \
    F(moept_config, intermediate_size) F(moept_config, num_experts) F(moept_config, top_k) \
    F(moept_config, norm_topk_prob) F(moept_config, activation) \
    F(moept_config, shared_intermediate_size) F(moept_config, shared_gate) F(moept_config, n_group) \
    F(moept_config, topk_group) F(moept_config, routed_scaling_factor) F(moept_config, aux_loss) \
    F(moept_config, aux_loss_coef) F(moept_config, group_fill) F(moept_config, aux_seq_len) \
    F(moept_config, z_loss_coef) F(moept_config, capacity_factor) F(moept_config, max_tokens) \
    F(moept_config, global_balance) F(moept_config, overlap_chunks) \
    F(moept_config, expert_sharding) F(moept_config, router_jitter) F(moept_config, jitter_seed) \
    F(moept_config, inference_only) F(moept_config, grad_backup) F(moept_config, max_inflight) \
    F(moept_config, fp8) \
    S(moept_stats) F(moept_stats, steps) F(moept_stats, tokens) F(moept_stats, routed_rows) \
    F(moept_stats, dropped_rows) F(moept_stats, masked_tokens) F(moept_stats, capacity) \
    F(moept_stats, aux_loss) F(moept_stats, z_loss) F(moept_stats, allocations) \
    F(moept_stats, allocated_bytes) F(moept_stats, workspace_bytes) F(moept_stats, param_bytes) \
    F(moept_stats, rows_sent) F(moept_stats, rows_received) F(moept_stats, bytes_sent) \
    F(moept_stats, bytes_received) F(moept_stats, comm_seconds) F(moept_stats, dispatch_seconds) \
    F(moept_stats, combine_seconds) F(moept_stats, recv_capacity) F(moept_stats, recv_growths) \
    F(moept_stats, checkpoint_bytes_read) F(moept_stats, device_workspace_bytes) \
    F(moept_stats, shared_exchange) F(moept_stats, host_bytes) F(moept_stats, device_bytes) \
    S(moept_forward_opts) F(moept_forward_opts, mask) F(moept_forward_opts, eval) \
    F(moept_forward_opts, replay_ids) F(moept_forward_opts, logits_out) F(moept_forward_opts, slot) \
    S(moept_backward_opts) F(moept_backward_opts, router_loss_scale) F(moept_backward_opts, dlogits) \
    F(moept_backward_opts, slot) \
    S(moept_param_info) F(moept_param_info, name) F(moept_param_info, rows) \
    F(moept_param_info, cols) F(moept_param_info, data) F(moept_param_info, grad) \
    F(moept_param_info, shard_offset) F(moept_param_info, offset) \
    S(moept_adamw) F(moept_adamw, lr) F(moept_adamw, beta1) F(moept_adamw, beta2) \
    F(moept_adamw, eps) F(moept_adamw, weight_decay) \
    S(moept_reshard_report) F(moept_reshard_report, experts_moved) \
    F(moept_reshard_report, bytes_sent) F(moept_reshard_report, bytes_received) \
    F(moept_reshard_report, rounds) F(moept_reshard_report, extra_bytes) \
    S(moept_st_tensor) F(moept_st_tensor, name) F(moept_st_tensor, dtype) F(moept_st_tensor, ndim) \
    F(moept_st_tensor, shape) F(moept_st_tensor, numel) F(moept_st_tensor, offset) \
    F(moept_st_tensor, nbytes) \
    S(moept_cuda_options) F(moept_cuda_options, dtype) F(moept_cuda_options, stream) \
    F(moept_cuda_options, unchecked_backward) F(moept_cuda_options, sync_free) \
    F(moept_cuda_options, gemm_form) \
    S(moept_p2p) F(moept_p2p, peer) F(moept_p2p, buf) F(moept_p2p, bytes) \
    S(moept_comm_ops) F(moept_comm_ops, alltoallv) F(moept_comm_ops, allreduce) \
    F(moept_comm_ops, allgather) F(moept_comm_ops, p2p) F(moept_comm_ops, barrier)

#ifdef __cplusplus
}
#endif
#endif /* MOEPT_H */

/* ======================================================================
   End of the API. What follows is internal (MOEPT_INTERNAL): the contract
   between the layer (moept.c, which runs the CPU executor) and the CUDA
   executor (moept_kernels.cu), and the few pieces the tests and benchmarks
   that check both executors share. The per-element math both executors run
   is moept.c's first section, which moept_kernels.cu compiles alone.
   ====================================================================== */
#if defined(MOEPT_INTERNAL) && !defined(MOEPT_INTERNAL_DECLS)
#define MOEPT_INTERNAL_DECLS
#include <math.h>
#include <string.h>
#ifdef __CUDACC__
#define MOEPT_HD __host__ __device__
#else
#define MOEPT_HD
#endif
#define MOEPT__ERRLEN 512 /* error message buffers */

/* bfloat16 <-> float by bits: round to nearest even, NaN kept quiet. The
   GPU's conversions and the checkpoint reader's both go through these. */
MOEPT_HD static inline uint16_t moept__f32_to_bf16(float f) {
    union { float f; uint32_t u; } b; b.f = f;
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b.u >> 16) | 0x40u);
    uint32_t r = b.u + 0x7fffu + ((b.u >> 16) & 1u);
    return (uint16_t)(r >> 16);
}
MOEPT_HD static inline float moept__bf16_to_f32(uint16_t h) {
    union { float f; uint32_t u; } b; b.u = (uint32_t)h << 16;
    return b.f;
}

/* ---- GEMM descriptor --------------------------------------------------
   Row-major C[m][n] = alpha * op(A)[m][k] op(B)[k][n] + beta * C. The stages
   build these; the builtin GEMM, CBLAS and cuBLAS all execute the same
   descriptors. The pointers' element type is the executor's (fp32 on the
   CPU; fp32 or bf16 operands with fp32 or bf16 C on the GPU). */
typedef struct moept__gemm {
    int trans_a, trans_b;  /* 0: op(X) = X, 1: op(X) = X^T */
    int64_t m, n, k;
    float alpha, beta;
    const float *a; int64_t lda;
    const float *b; int64_t ldb;
    float *c; int64_t ldc;
} moept__gemm;

static inline moept__gemm moept__gemm_make(int ta, int tb, int64_t m, int64_t n,
                                           int64_t k, const float *a, int64_t lda,
                                           const float *b, int64_t ldb, float beta,
                                           float *c, int64_t ldc) {
    moept__gemm g;
    g.trans_a = ta; g.trans_b = tb; g.m = m; g.n = n; g.k = k;
    g.alpha = 1.0f; g.beta = beta;
    g.a = a; g.lda = lda; g.b = b; g.ldb = ldb; g.c = c; g.ldc = ldc;
    return g;
}

/* The column-major (BLAS/cuBLAS) call computing a row-major descriptor: a
   row-major [m][n] matrix is a column-major [n][m] one, so C^T = op(B)^T
   op(A)^T: operands swapped, m and n swapped, transposes kept. */
typedef struct moept__gemm_cm {
    int trans_a, trans_b;  /* cuBLAS transa / transb */
    int64_t m, n, k;
    const void *a; int64_t lda;  /* = the descriptor's B */
    const void *b; int64_t ldb;  /* = its A */
    void *c; int64_t ldc;
    float alpha, beta;
} moept__gemm_cm;
static inline moept__gemm_cm moept__gemm_colmajor(const moept__gemm *g) {
    moept__gemm_cm c;
    c.trans_a = g->trans_b; c.trans_b = g->trans_a;
    c.m = g->n; c.n = g->m; c.k = g->k;
    c.a = g->b; c.lda = g->ldb;
    c.b = g->a; c.ldb = g->lda;
    c.c = g->c; c.ldc = g->ldc;
    c.alpha = g->alpha; c.beta = g->beta;
    return c;
}

#ifdef __cplusplus
extern "C" {
#endif
/* ---- the executor interface ------------------------------------------
   An executor runs a layer's steps: the CPU executor (moept.c) from its
   stage functions, the CUDA executor (moept_kernels.cu) from its kernels.
   Every call goes through moept.c's MOEPT__EX: a NULL entry is a step that
   executor does not need. What an executor cannot do is a missing
   capability bit, refused in one place with one message shape. */
enum {
    MOEPT__CAN_JITTER = 1 << 0,      /* config.router_jitter */
    MOEPT__CAN_INFERENCE = 1 << 1,   /* config.inference_only */
    MOEPT__CAN_GRAD_BACKUP = 1 << 2, /* config.grad_backup */
    MOEPT__CAN_AUX_SEQ = 1 << 3,     /* MOEPT_AUX_SEQ */
    MOEPT__CAN_FSDP = 1 << 4,        /* config.expert_sharding = MOEPT_SHARD_FSDP */
    MOEPT__CAN_MASK = 1 << 5,        /* moept_forward_ex's opts.mask */
    MOEPT__CAN_RESHARD = 1 << 6,     /* moept_reshard */
    MOEPT__CAN_HOST_STEPS = 1 << 7,  /* the steps run on the host: the CPU workspace is its own */
    MOEPT__CAN_DEVICE = 1 << 8,      /* parameters on a device (moept_cuda_params) */
    MOEPT__CAN_FP8 = 1 << 9,         /* config.fp8 */
    MOEPT__NCAPS = 10
};
/* an executor's buffers (moept_buf's values, then AdamW's moments) */
enum { MOEPT__BUF_M = 2, MOEPT__BUF_V = 3 };
/* AdamW's constants for one step (moept.c's moept__adamw1) */
typedef struct moept__adamw_k { float decay, b1, b2, step, sbc2, eps; } moept__adamw_k;
/* moept_reshard's schedule (moept__reshard_plan), the same on every rank */
typedef struct moept__moves {
    const int32_t *new_rank, *nslot; /* [E] the placement asked for, each expert's new slot */
    const int32_t *go, *come;        /* [rounds][P] the expert each rank sends, receives (-1: idle) */
    int64_t rounds, n;               /* n: the rounds this rank is not idle in */
} moept__moves;
/* A forward's arguments, packed once by moept_forward_ex for every
   executor's stages, and what the CPU's stages found before the commit
   (the routing is in the spare buffers nb). */
typedef struct moept__fstep {
    const float *x;        /* [T][D] */
    float *y;              /* [T][D] */
    const uint8_t *mask;   /* [T] 0 = padding, or NULL */
    const int32_t *replay; /* [T][K] the experts to route to (routing replay), or NULL */
    float *logits_out;     /* [T][E] the router's logits written here, or NULL */
    int slot;              /* the training forward's slot (opts.slot) */
    int64_t T, valid;      /* tokens; unmasked ones */
    int eval, global, nb;
    int jitter;            /* the router sees x * u (router_jitter, a training forward) */
    uint64_t x_fp;         /* x's fingerprint, for the backward's check */
    uint64_t jkey;         /* the jitter noise's key (moept__jitter_key) */
    int64_t cap, R_next;   /* per-expert capacity (-1 dropless); rows to receive */
    moept_status reject;   /* the executor refuses this call (agreed as a local check) */
    char reject_why[MOEPT__ERRLEN];
} moept__fstep;
typedef struct moept__exec {
    const char *name;      /* in refusals: "the CUDA executor" */
    unsigned caps;         /* MOEPT__CAN_* */
    /* the steps (after the API's checks; each agrees over the group itself) */
    moept_status (*forward)(moept_layer *L, moept__fstep *f);
    moept_status (*backward)(moept_layer *L, const float *x, const float *dy, float *dx,
                             const moept_backward_opts *o); /* o: never NULL */
    moept_status (*sync_grads)(moept_layer *L, float scale);     /* after the call's agreement */
    moept_status (*grad_scan)(moept_layer *L, double *s, int64_t *bad);
    /* AdamW's check (NULL: grad_scan's sums): *g2 >= every gradient's square, and
       the first non-finite element (-1: none) */
    moept_status (*grad_max)(moept_layer *L, double *g2, int64_t *bad);
    moept_status (*adamw_ready)(moept_layer *L);                 /* before the agreement */
    moept_status (*adamw)(moept_layer *L, moept__adamw_k k);     /* after it */
    /* the step with k computed, nothing written: the first element whose m,
       v or p would not be finite (index * 4 + 1, 2, 3; -1: none), the new
       moments' max |m| and max v where all are */
    moept_status (*adamw_probe)(moept_layer *L, moept__adamw_k k, int64_t *bad, double *mmax, double *vmax);
    moept_status (*zero_grad)(moept_layer *L); /* NULL: the host's memset */
    moept_status (*grads_check)(moept_layer *L); /* read checks the executor made without a sync */
    moept_status (*settle)(moept_layer *L);      /* statistics the executor deferred */
    moept_status (*routing)(moept_layer *L, int dweights); /* ids/wts/logits (or dwts) to the host */
    /* a device executor's buffers (its own home: the host holds no copy), elements
       [off, off + n) of buffer `which` (moept_buf, MOEPT__BUF_M/V) to or from host
       memory h (n 0: the device's pending errors, checked); a parameter write marks the
       executor's derived copies stale (the writer calls params_changed once after its
       writes). NULL: the layer's buffers are the host's (moept__params) */
    moept_status (*io)(moept_layer *L, int which, int64_t off, int64_t n, float *h, int write);
    moept_status (*tables)(moept_layer *L); /* the host's bias and placement changed (O(E)) */
    moept_status (*device_params)(moept_layer *L, float **params, float **grads);
    moept_status (*params_changed)(moept_layer *L);
    /* moept_reshard's moves (NULL: the host's rounds): ready before the
       agreement (this rank's resources for mv->n moves); then, agreed, the
       moves and their own agreement (a failure on any rank undoes every
       rank's), or, not agreed, the resources released */
    moept_status (*reshard_ready)(moept_layer *L, const moept__moves *mv);
    moept_status (*reshard)(moept_layer *L, const moept__moves *mv, int agreed, int64_t *sent,
                            int64_t *recvd);
    void (*stale_forwards)(moept_layer *L, const char *call); /* moept__stale_forwards (NULL: none) */
    void (*destroy)(moept_layer *L);
} moept__exec;
/* The group calls: each agreement carries the call's id (moept.c's table names them) */
enum {
    MOEPT__CALL_FORWARD = 1, MOEPT__CALL_BACKWARD, MOEPT__CALL_SYNC_GRADS, MOEPT__CALL_GRAD_NORM,
    MOEPT__CALL_UPDATE_BIAS, MOEPT__CALL_ADAMW_STEP, MOEPT__CALL_SAVE_CHECKPOINT, MOEPT__CALL_SAVE_FILES,
    MOEPT__CALL_SAVE_COMMIT, MOEPT__CALL_LOAD_CHECKPOINT, MOEPT__CALL_LOAD_HF, MOEPT__CALL_RESHARD,
    MOEPT__CALL_LOAD_COMMIT, MOEPT__NCALLS
};

/* Results of a forward the host keeps (statistics and the saved state's size);
   tag in: the call's agreement tag (moept.c's call counter), agreed out: the
   ranks exchanged their tags (the layer counts the call); reject in: fail
   this call on every rank with reject_msg. */
typedef struct moept__dev_step {
    int64_t tag;
    int agreed;
    moept_status reject;       /* in: a rejection moept.c found (an option this executor
                                  lacks, ...), agreed like the executor's own checks */
    const char *reject_msg;
    const moept__fstep *f;     /* in (forward): its arguments as moept_forward_ex packed them (x, y,
                                  T, mask, replay ids, logits_out, eval, jitter: device pointers) */
    int slot;                  /* in (backward): opts.slot; out (forward): the slot it used (an
                                  evaluation's: moept__eval_slot_of) */
    float router_loss_scale;   /* in (backward): the aux and z gradients' factor */
    const float *dlogits;      /* in (backward): [T][E] the caller's dL/dlogits (device), or NULL */
    int64_t valid;             /* out: this rank's unmasked tokens (deferred as N) */
    int64_t N, R, capacity, rows_sent, rows_received, recv_capacity, recv_growths;
    double aux_value, z_value, loss_T;
    int counts_global;
    int deferred;              /* sync-free: the values from N to counts_global (and lstat, peer_rows) are
                                  on the device; the executor's step_stats reads them */
    double comm_seconds;
    int64_t bytes_sent, bytes_received;
} moept__dev_step;
/* What a device executor sees of its layer: its shape and the layer's
   current host buffers (moept__view_of fills it; pointers may change
   between calls, e.g. the moments appear at the first step or save). */
typedef struct moept__view {
    const moept_config *cfg;       /* resolved: the layer's own, unchanged while it lives */
    int64_t D, F, E, K, S, H, HS, El, Tmax, C, n_params;
    int P, rank, nslots, act;
    double capacity_factor;        /* the config's, read as the decimal it was written as */
    moept_comm *ep, *dp;           /* NULL: one rank */
    void **xstate;                 /* the executor's own state */
    int grads;                     /* the layer has gradients (not inference_only) */
    int moments;                   /* AdamW's moments move with their experts (a step was taken:
                                      agreed state, the same on every rank) */
    float *bias;                   /* [E] the correction bias (its one home) */
    int64_t off13, off2, offs13, offs2, offsg; /* offsets in params; offsg -1: no shared gate */
    int32_t *slot_of;              /* [E] the placement */
    double *lstat;                 /* [moept__lstat_of(E).n] the last forward's loss statistics */
    int64_t *peer_rows;            /* [2][P] its rows sent to / received from each peer */
    int32_t *ids;                  /* [Tmax][K] its routing, host copies: ids, */
    float *wts, *logits;           /* [Tmax][K] weights, [Tmax][E] logits */
    float *dwts;                   /* [Tmax][K] dL/d routing weight (after a backward) */
} moept__view;
void moept__view_of(moept_layer *L, moept__view *v);
/* A device executor's reports: the calls agreed (tags used), what it
   holds (its allocations and bytes since create; now: its device's bytes by
   moept_mem_kind and its own host blocks' bytes), a forward done (its statistics, unless deferred), the
   deferred statistics read, a backward done (last: of the last forward),
   jitter forwards counted by a failed sync-free forward, and the checks it
   made on the device (dx's first non-finite element, a sync-free check) */
void moept__dev_agreed(moept_layer *L, int n);
void moept__dev_held(moept_layer *L, int64_t allocations, int64_t bytes,
                     const int64_t device[MOEPT_MEM_NKINDS], int64_t host);
void moept__dev_forward_done(moept_layer *L, const moept__dev_step *r);
void moept__dev_step_done(moept_layer *L, const moept__dev_step *r);
void moept__dev_backward_done(moept_layer *L, const moept__dev_step *r, int last);
void moept__dev_count_jitter(moept_layer *L, int n);
void moept__dev_grads_bad(moept_layer *L, int64_t bad, int64_t dl_bad, moept_status why_st, const char *why);
/* moept.c's helpers a device executor calls: the layer made with an
   executor; failures (the calling thread's message, moept__errbuf); the
   call tag; the jitter key; sums and maxima over the
   groups (moept__any_failed: 0 when no rank failed) */
moept_status moept__create(const moept_config *cfg, moept_comm *ep, moept_comm *dp, const moept__exec *ex,
                           const char *call, moept_layer **out);
moept_status moept__fail(const moept_layer *L, moept_status s, const char *fmt, ...);
moept_status moept__thread_fail(moept_status s, const char *fmt, ...);
char *moept__errbuf(void); /* [MOEPT__ERRLEN] */
int64_t moept__call_tag(const moept_layer *L, int call);
uint64_t moept__jitter_key(const moept_layer *L);
moept_status moept__sum_ep_dp(moept_comm *ep, moept_comm *dp, void *buf, int64_t n, moept_dtype t,
                              moept_comm **bad);
int64_t moept__any_failed(moept_comm *ep, moept_comm *dp, int64_t mine, moept_status *st);
moept_status moept__group_max(moept_comm *g, int64_t v, int64_t *most);
/* The thread group's part in moept_comm_cuda_threads: a rank's comm claimed
   (a second claim fails and breaks the group; a broken group refuses) and
   released; the destroy's barrier (-1: not met, a peer's call breaks it) */
moept_status moept__thr_claim(moept_thread_group *g, int rank);
void moept__thr_release(moept_thread_group *g, int rank);
int moept__thr_destroy_barrier(moept_comm *host);
#ifdef __cplusplus
}
#endif
#endif /* MOEPT_INTERNAL */
