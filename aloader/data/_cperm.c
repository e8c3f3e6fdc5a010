#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Uniform random permutations for aloader._random.permutation.
 *
 * Rao-Sandelius scatter shuffle: each index draws one of NB buckets, a counting sort groups the
 * buckets, and each bucket (small enough to stay in cache) gets a Fisher-Yates shuffle. Given
 * i.i.d. uniform buckets and uniform in-bucket shuffles the result is exactly uniform.
 * Random numbers: xoshiro256** seeded by splitmix64; bounded draws: Lemire's method. */
typedef struct { uint64_t s[4]; } rng_t;
static inline uint64_t rotl(const uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
static inline uint64_t next64(rng_t *r) {
    uint64_t *s = r->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t; s[3] = rotl(s[3], 45);
    return result;
}
/* splitmix64 expands one 64-bit seed into the generator state. */
static void seed_rng(rng_t *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) {
        uint64_t z = (seed += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        r->s[i] = z ^ (z >> 31);
    }
}
/* Lemire's nearly divisionless bounded draw in [0, range) */
static inline uint64_t bounded(rng_t *r, uint64_t range) {
    __uint128_t m = (__uint128_t)next64(r) * range;
    uint64_t l = (uint64_t)m;
    if (l < range) {
        uint64_t t = -range % range;
        while (l < t) { m = (__uint128_t)next64(r) * range; l = (uint64_t)m; }
    }
    return (uint64_t)(m >> 64);
}

#define NB 1024

static void shuffle(int64_t *a, Py_ssize_t n, uint16_t *bucket, rng_t *r) {
    Py_ssize_t start[NB + 1], next[NB];
    memset(start, 0, sizeof start);
    /* Four 16-bit bucket draws per 64-bit random number. */
    for (Py_ssize_t i = 0; i < n; i += 4) {
        uint64_t x = next64(r);
        for (int k = 0; k < 4 && i + k < n; k++) {
            uint16_t v = (uint16_t)((x >> (16 * k)) & (NB - 1));
            bucket[i + k] = v;
            start[v + 1]++;
        }
    }
    for (int k = 0; k < NB; k++) start[k + 1] += start[k];
    memcpy(next, start, sizeof next);
    for (Py_ssize_t i = 0; i < n; i++) a[next[bucket[i]]++] = i;
    for (int k = 0; k < NB; k++) {
        int64_t *s = a + start[k];
        for (Py_ssize_t i = start[k + 1] - start[k] - 1; i > 0; i--) {
            uint64_t j = bounded(r, (uint64_t)i + 1);
            int64_t t = s[i];
            s[i] = s[j];
            s[j] = t;
        }
    }
}

static PyObject *permutation(PyObject *self, PyObject *args) {
    Py_buffer out;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "w*K", &out, &seed)) return NULL;
    if (out.itemsize != 8 || out.len % 8 != 0) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "permutation needs a writable int64 buffer");
        return NULL;
    }
    Py_ssize_t n = out.len / 8;
    uint16_t *bucket = malloc(sizeof(uint16_t) * (size_t)(n > 0 ? n : 1));
    if (bucket == NULL) {
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    rng_t r;
    seed_rng(&r, seed);
    Py_BEGIN_ALLOW_THREADS
    shuffle((int64_t *)out.buf, n, bucket, &r);
    Py_END_ALLOW_THREADS
    free(bucket);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}


/* torch.randperm(n, generator=torch.Generator().manual_seed(seed)) on the CPU, without torch
 * (DistributedSampler's shuffle): torch's mt19937 (std::mt19937's seeding from the seed's low
 * 32 bits) and its randperm_cpu. Below n = UINT32_MAX / 20 torch swaps position i with
 * i + random() % (n - i); from there on it runs an inside-out Fisher-Yates with
 * random64() % (i + 1), random64 being two 32-bit draws, the first the high half. */
typedef struct { uint32_t s[624]; int pos; } mt_t;
static void mt_seed(mt_t *m, uint32_t seed) {
    m->s[0] = seed;
    for (int j = 1; j < 624; j++)
        m->s[j] = 1812433253U * (m->s[j - 1] ^ (m->s[j - 1] >> 30)) + (uint32_t)j;
    m->pos = 624;
}
static void mt_twist(mt_t *m) {
    uint32_t *s = m->s;
    for (int i = 0; i < 624; i++) {
        uint32_t y = (s[i] & 0x80000000U) | (s[(i + 1) % 624] & 0x7fffffffU);
        s[i] = s[(i + 397) % 624] ^ (y >> 1) ^ ((y & 1U) ? 0x9908b0dfU : 0U);
    }
    m->pos = 0;
}
static inline uint32_t mt_next(mt_t *m) {
    if (m->pos >= 624) mt_twist(m);
    uint32_t y = m->s[m->pos++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= y >> 18;
    return y;
}
static void torch_perm(int64_t *a, int64_t n, mt_t *m) {
    if (n < (int64_t)(UINT32_MAX / 20)) {
        for (int64_t i = 0; i < n; i++) a[i] = i;
        for (int64_t i = 0; i < n - 1; i++) {
            int64_t z = (int64_t)(mt_next(m) % (uint64_t)(n - i)) + i;
            int64_t t = a[i];
            a[i] = a[z];
            a[z] = t;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t hi = mt_next(m);
        uint64_t r = (hi << 32) | mt_next(m);
        int64_t z = (int64_t)(r % (uint64_t)(i + 1));
        a[i] = a[z];
        a[z] = i;
    }
}

static PyObject *torch_shuffle(PyObject *self, PyObject *args) {
    Py_buffer out;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "w*K", &out, &seed)) return NULL;
    if (out.itemsize != 8 || out.len % 8 != 0) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "torch_shuffle needs a writable int64 buffer");
        return NULL;
    }
    mt_t *m = malloc(sizeof(mt_t));
    if (m == NULL) {
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    mt_seed(m, (uint32_t)seed);
    Py_BEGIN_ALLOW_THREADS
    torch_perm((int64_t *)out.buf, (int64_t)(out.len / 8), m);
    Py_END_ALLOW_THREADS
    free(m);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"permutation", permutation, METH_VARARGS, "Fill an int64 buffer with a uniform random permutation of range(len)."},
    {"torch_shuffle", torch_shuffle, METH_VARARGS, "Fill an int64 buffer with torch.randperm(len) of a CPU generator seeded with seed."},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_cperm", NULL, -1, methods};
PyMODINIT_FUNC PyInit__cperm(void) { return PyModule_Create(&mod); }
