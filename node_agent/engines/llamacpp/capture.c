/* The eval callback that makes a llama.cpp context run only a stage's layers.
 *
 * ggml's scheduler asks the callback, node by node, whether it wants to see a
 * node; for the one we want (the stage's last layer output, "l_out-{n-1}") it
 * computes up to there, hands the tensor over, and stops the graph when the
 * callback returns false: the final norm and the LM head are never computed.
 * Written in C because a Python callback costs 0.7-1.5 ms per decode step
 * (~300 nodes, each taking the GIL); this one costs nothing measurable.
 *
 * No ggml header is needed: the three ggml functions it calls come in as
 * pointers from the libggml-base that llama-cpp-python loaded, so this file
 * does not depend on ggml's struct layout, which changes between releases.
 * Loaded with ctypes (node_agent/engines/llamacpp/library.py); built by
 * setuptools as an extension module only so that pip compiles it.
 */
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

struct ggml_tensor;

struct edgebus_capture {
    char target[64];  /* node name: "l_out-{n_layer - 1}" */
    const char * (*get_name)(const struct ggml_tensor *);
    size_t (*nbytes)(const struct ggml_tensor *);
    void (*tensor_get)(const struct ggml_tensor *, void *, size_t, size_t);
    char * buf;        /* float32 rows, one per batch position */
    size_t cap_bytes;
    size_t off_bytes;  /* bytes written since the caller reset it: one node per ubatch */
};

bool edgebus_capture_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    struct edgebus_capture * c = (struct edgebus_capture *) user_data;
    const bool wanted = strcmp(c->get_name(t), c->target) == 0;
    if (ask || !wanted) {
        return ask ? wanted : true;
    }
    const size_t nb = c->nbytes(t);
    if (c->off_bytes + nb <= c->cap_bytes) {
        c->tensor_get(t, c->buf + c->off_bytes, 0, nb);
    }
    c->off_bytes += nb;  /* past cap_bytes: the caller sees the overflow and refuses the rows */
    return false;
}

/* Python extension modules must export PyInit_<name>; this one is never imported. */
void * PyInit__capture(void) { return NULL; }
