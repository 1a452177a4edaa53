/* Are k rows in one llama_decode call bitwise equal to k one-row calls?  (issue 42, item 1)
 * The C twin of tools/row_exactness.py, for CPUs where the Python bindings are not at hand
 * (a Cortex-A76 under qemu-user). Same two tests, same table:
 *   pos: k positions of ONE sequence in one call vs the same k positions one per call;
 *   seq: one row each of k sequences (ids 0..k-1, kv_unified = false) in one call vs each alone.
 * Logits and hidden states (final norm output, embeddings with pooling NONE) compared with memcmp.
 *
 * usage: probe GGUF THREADS FA(0|1) EXTRA_BUFTS(1|0|r) KS [REGEX ...]
 *   KS: comma list, e.g. 1,2,3,4,5,6,7,8,16,32. EXTRA_BUFTS 1: llama.cpp's default (REGEX tensors
 *   overridden to ggml_backend_cpu_buffer_type(), which llama.cpp still repacks); 0: use_extra_bufts
 *   = false; r: use_extra_bufts = false and only the REGEX tensors in the CPU_REPACK buffer type.
 *   Env GGML_CPU_TILED_MM=0 turns off the x86 tiled K-quant matmul (>= 8 rows).
 *
 * Build for the Pi 5's core (llama.cpp from the llama-cpp-python 0.3.36 sdist, vendor/llama.cpp,
 * cross-built as in docs/row-exactness.md: -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16
 * -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON, cmake --build B --target llama):
 *   aarch64-linux-gnu-gcc -O2 -o row_exactness tools/row_exactness.c -I$LLAMA/include \
 *       -I$LLAMA/ggml/include -L$B/bin -lllama -lggml -lggml-base -Wl,-rpath,$B/bin
 *   QEMU_CPU=cortex-a76 qemu-aarch64-static -L /usr/aarch64-linux-gnu ./row_exactness m.gguf 1 0 1 1,2,4
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"
#include "ggml-backend.h"

#define PROMPT 40
#define CTX_PER_SEQ 512
#define MAXK 64

static struct llama_model *model;
static int threads, fa, nv, nd;
static float *ref_l, *ref_h, *got_l, *got_h;   /* MAXK rows each */

static void quiet(enum ggml_log_level l, const char *t, void *u) { (void)l; (void)t; (void)u; }

static struct llama_context *context(int nseq) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = CTX_PER_SEQ * nseq; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = nseq;
    cp.kv_unified = false; cp.n_threads = cp.n_threads_batch = threads;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.embeddings = true; cp.pooling_type = LLAMA_POOLING_TYPE_NONE;
    struct llama_context *c = llama_init_from_model(model, cp);
    if (!c) { fprintf(stderr, "no context\n"); exit(1); }
    return c;
}

/* decode n rows (tok, pos, seq); if lg, copy the rows' logits and hidden states to lg[], hs[] */
static void decode(struct llama_context *c, int n, const int *tok, const int *pos, const int *seq,
                   float *lg, float *hs) {
    struct llama_batch b = llama_batch_init(n, 0, 1);
    b.n_tokens = n;
    for (int i = 0; i < n; i++) {
        b.token[i] = tok[i]; b.pos[i] = pos[i]; b.n_seq_id[i] = 1; b.seq_id[i][0] = seq[i];
        b.logits[i] = lg != NULL;
    }
    if (llama_decode(c, b) != 0) { fprintf(stderr, "decode failed\n"); exit(1); }
    for (int i = 0; lg && i < n; i++) {
        memcpy(lg + (size_t)i * nv, llama_get_logits_ith(c, i), sizeof(float) * nv);
        memcpy(hs + (size_t)i * nd, llama_get_embeddings_ith(c, i), sizeof(float) * nd);
    }
    llama_batch_free(b);
}

static int prompt[PROMPT + 8], drafts[MAXK];

static void prefill(struct llama_context *c, int s, int len, int off) {
    int tok[PROMPT + 8], pos[PROMPT + 8], seq[PROMPT + 8];
    for (int i = 0; i < len; i++) { tok[i] = prompt[off + i]; pos[i] = i; seq[i] = s; }
    decode(c, len, tok, pos, seq, NULL, NULL);
}

/* one row per call into ref, then all k rows in one call into got */
static void run(int k, int nseq, const int *tok, const int *pos, const int *seq,
                const int *len, const int *off) {
    for (int pass = 0; pass < 2; pass++) {
        struct llama_context *c = context(nseq);
        for (int s = 0; s < nseq; s++) prefill(c, s, len[s], off[s]);
        if (pass == 0)
            for (int i = 0; i < k; i++)
                decode(c, 1, tok + i, pos + i, seq + i, ref_l + (size_t)i * nv, ref_h + (size_t)i * nd);
        else
            decode(c, k, tok, pos, seq, got_l, got_h);
        llama_free(c);
    }
}

static int compare(int k, int *heq) {
    int leq = 0; *heq = 0;
    for (int i = 0; i < k; i++) {
        leq += !memcmp(ref_l + (size_t)i * nv, got_l + (size_t)i * nv, sizeof(float) * nv);
        *heq += !memcmp(ref_h + (size_t)i * nd, got_h + (size_t)i * nd, sizeof(float) * nd);
    }
    return leq;
}

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s GGUF THREADS FA EXTRA_BUFTS KS [REGEX...]\n", argv[0]); return 2; }
    threads = atoi(argv[2]); fa = atoi(argv[3]);
    if (!getenv("ROWS_VERBOSE")) llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    /* EXTRA_BUFTS: 1 default; 0 use_extra_bufts = false; r: false, and the REGEX tensors to CPU_REPACK */
    mp.use_extra_bufts = argv[4][0] == '1';
    ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
    if (argv[4][0] == 'r') {
        /* a CPU override means "CPU or its extra types" to llama.cpp (llama-model-loader.cpp); a named
           extra type is taken as is. Name only tensors of types the CPU repacks, or it crashes. */
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        typedef ggml_backend_buffer_type_t *(*extra_fn)(ggml_backend_dev_t);
        extra_fn fn = (extra_fn)ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                   "ggml_backend_dev_get_extra_bufts");
        buft = NULL;
        for (ggml_backend_buffer_type_t *b = fn ? fn(dev) : NULL; b && *b; b++)
            if (!strcmp(ggml_backend_buft_name(*b), "CPU_REPACK")) buft = *b;
        if (!buft) { fprintf(stderr, "no CPU_REPACK buffer type\n"); return 1; }
    }
    struct llama_model_tensor_buft_override ov[16] = {{0}};
    for (int i = 6; i < argc && i - 6 < 15; i++) { ov[i - 6].pattern = argv[i]; ov[i - 6].buft = buft; }
    if (argc > 6) mp.tensor_buft_overrides = ov;
    model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    nv = llama_vocab_n_tokens(llama_model_get_vocab(model)); nd = llama_model_n_embd(model);
    ref_l = malloc(sizeof(float) * MAXK * nv); got_l = malloc(sizeof(float) * MAXK * nv);
    ref_h = malloc(sizeof(float) * MAXK * nd); got_h = malloc(sizeof(float) * MAXK * nd);
    srand(1);
    for (int i = 0; i < PROMPT + 8; i++) prompt[i] = 100 + rand() % (nv - 200);
    for (int i = 0; i < MAXK; i++) drafts[i] = 100 + rand() % (nv - 200);

    printf("# %s threads=%d fa=%d extra_bufts=%s overrides=%d%s%s\n", argv[1], threads, fa, argv[4], argc - 6,
           argc > 6 ? " first=" : "", argc > 6 ? argv[6] : "");
    printf("  k | pos: logits hidden | seq: logits hidden\n");
    int best[4] = {0}, alive[4] = {1, 1, 1, 1};  /* pos logits, pos hidden, seq logits, seq hidden */
    for (char *ks = argv[5]; *ks; ) {
        int k = (int)strtol(ks, &ks, 10); if (*ks == ',') ks++;
        if (k < 1 || k > MAXK) continue;
        int tok[MAXK], pos[MAXK], seq[MAXK], len[MAXK], off[MAXK], eq[4];
        for (int i = 0; i < k; i++) { tok[i] = drafts[i]; pos[i] = PROMPT + i; seq[i] = 0; }
        len[0] = PROMPT; off[0] = 0;
        run(k, 1, tok, pos, seq, len, off);
        eq[0] = compare(k, &eq[1]);
        for (int s = 0; s < k; s++) { len[s] = PROMPT - 10 + s % 11; off[s] = s % 7; tok[s] = drafts[s]; pos[s] = len[s]; seq[s] = s; }
        run(k, k, tok, pos, seq, len, off);
        eq[2] = compare(k, &eq[3]);
        printf("%3d | %5d/%-3d %3d/%-3d | %5d/%-3d %3d/%-3d\n", k, eq[0], k, eq[1], k, eq[2], k, eq[3], k);
        fflush(stdout);
        int any = 0;
        for (int j = 0; j < 4; j++) { if (alive[j] && eq[j] == k) best[j] = k; else alive[j] = 0; any |= alive[j]; }
        if (!any) break;  /* every test failed: larger k adds nothing to the answer */
    }
    printf("largest exact k: positions of one sequence: logits %d hidden %d; rows of k sequences: logits %d hidden %d\n",
           best[0], best[1], best[2], best[3]);
    llama_model_free(model);
    return 0;
}
