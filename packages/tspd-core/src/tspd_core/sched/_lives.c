/* A short request's life -- admission, prompt completion, finish -- compiled.
 *
 * The same three steps as tspd_core/sched/short.py, page by page, on the same memory: the
 * pool's reference counts and free stack, the prefix store's run / key / stamp arrays and its
 * eviction queue, the slot table's columns. Every rule is short.py's (same pages in the same
 * order, same hits, evictions, recency stamps and free-stack order); the Python counters
 * (the pool's top, the store's and the queue's) stay on their Python objects and are read
 * and written here through their attributes, so both paths, and the numpy path, share one
 * state. tests/sched runs this path, short.py's and the numpy path side by side.
 *
 * What this file does not do it hands back: a strict (checking) pool and a long request's
 * key array return NotImplemented and the caller takes short.py's path; the store's rare
 * bulk work (an insert that must evict, sweeping runs, rebuilding its dict, compacting the
 * queue) is its Python methods, called from here.
 *
 * Why: a Python step costs 20-90 ns, and a short life is ~150 of them plus a dozen calls;
 * here a page costs a few ns and the life is the calls (scheduler.py's checks, the
 * Admission record, the dict look-ups of the keys).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Buffers held for the object's life: arrays that are never replaced. */
enum {
    B_RC,        /* pool._refcount, int32, page -> references */
    B_FS,        /* pool._free, intp, the free stack (top at pool._top) */
    B_TABLE,     /* slots.tables, int32, capacity x logical_pages */
    B_STATE,     /* slots.state, int8 */
    B_PROMPT,    /* slots.prompt_len, int32 */
    B_PREFIX,    /* slots.prefix_tokens, int32 */
    B_KV,        /* slots.kv_len, int32 */
    B_NPAGES,    /* slots.num_pages, int32 */
    B_SERIAL,    /* slots.serial, int64 */
    B_ADMISSION, /* slots.admission, int64 */
    B_RUN,       /* store._run_py, int64, page -> run id (0: not cached) */
    B_KEY,       /* store._key_py, uint64, page -> key */
    B_STAMP,     /* store._stamp, int64, page -> recency stamp (0: not evictable) */
    B_FIXED      /* how many; the store's three only with a store */
};
#define MAX_CLEARED 16

typedef struct {
    PyObject_HEAD
    /* Not the scheduler, which holds this object: no cycle (the type is not GC-tracked). */
    PyObject *pool, *store, *slots, *queue, *admission_type;
    Py_buffer buf[B_FIXED];
    int held;      /* buffers held: buf[0 .. held) */
    Py_buffer cleared[MAX_CLEARED]; /* slots._cleared: zeroed by clear */
    int ncleared;
    long long page_size, logical_pages, capacity, pages_len, stale_factor;
} Lives;

/* Interned attribute names and the heapq functions (module init). */
static PyObject *S_top, *S_strict, *S_page_of, *S_evictable, *S_clock, *S_entries, *S_run_ids,
    *S_runs, *S_run_entries, *S_sweep_at, *S_size, *S_max_entries, *S_evicted_total, *S_head,
    *S_tail, *S_pmv, *S_smv, *S_compact, *S_live, *S_sweep, *S_rebuild_map, *S_insert,
    *S_trusted, *S_free_heap, *S_serials, *S_rids, *S_index, *S_keys, *S_admissions,
    *S_prompt_tokens, *S_hit_tokens, *S_queue, *S_refcount, *S_free, *S_tables, *S_state,
    *S_prompt_len, *S_prefix_tokens, *S_kv_len, *S_num_pages, *S_serial, *S_admission,
    *S_run_py, *S_key_py, *S_stamp, *S_cleared, *S_logical_pages, *S_capacity, *S_STALE;
static PyObject *heappop, *heappush;

#define I32(self, b) ((int32_t *)(self)->buf[b].buf)
#define I64(self, b) ((int64_t *)(self)->buf[b].buf)

/* ---- attribute helpers ------------------------------------------------------------- */

static int get_ll(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_ll(PyObject *obj, PyObject *name, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

static int add_ll(PyObject *obj, PyObject *name, long long delta) {
    long long v;
    if (get_ll(obj, name, &v) < 0) return -1;
    return set_ll(obj, name, v + delta);
}

/* 1 when the pool checks every call (short.py's path then), 0 when not, -1 on error. */
static int pool_strict(Lives *self) {
    PyObject *v = PyObject_GetAttr(self->pool, S_strict);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static int hold(Lives *self, PyObject *owner, PyObject *name, Py_ssize_t itemsize) {
    PyObject *obj = PyObject_GetAttr(owner, name);
    if (obj == NULL) return -1;
    Py_buffer *view = &self->buf[self->held];
    int rc = PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
    Py_DECREF(obj);
    if (rc < 0) return -1;
    self->held++;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%U: items of %zd bytes, expected %zd", name,
                     view->itemsize, itemsize);
        return -1;
    }
    return 0;
}

/* ---- construction ------------------------------------------------------------------ */

static void Lives_dealloc(Lives *self) {
    for (int i = 0; i < self->held; i++) PyBuffer_Release(&self->buf[i]);
    for (int i = 0; i < self->ncleared; i++) PyBuffer_Release(&self->cleared[i]);
    Py_XDECREF(self->pool);
    Py_XDECREF(self->store);
    Py_XDECREF(self->slots);
    Py_XDECREF(self->queue);
    Py_XDECREF(self->admission_type);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Lives_init(Lives *self, PyObject *args, PyObject *kwds) {
    PyObject *pool, *store, *slots, *admission_type;
    long long page_size;
    static char *names[] = {"pool", "store", "slots", "admission", "page_size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOL", names, &pool, &store, &slots,
                                     &admission_type, &page_size))
        return -1;
    if (self->held || self->pool) {
        PyErr_SetString(PyExc_RuntimeError, "Lives is initialised once");
        return -1;
    }
    if (page_size < 1) {
        PyErr_SetString(PyExc_ValueError, "page_size must be >= 1");
        return -1;
    }
    self->page_size = page_size;
    Py_INCREF(pool); self->pool = pool;
    Py_INCREF(slots); self->slots = slots;
    Py_INCREF(admission_type); self->admission_type = admission_type;
    if (store != Py_None) {
        Py_INCREF(store); self->store = store;
        self->queue = PyObject_GetAttr(store, S_queue);
        if (self->queue == NULL) return -1;
        if (get_ll(store, S_STALE, &self->stale_factor) < 0) return -1;
    }
    if (get_ll(slots, S_logical_pages, &self->logical_pages) < 0) return -1;
    if (get_ll(slots, S_capacity, &self->capacity) < 0) return -1;
    if (hold(self, pool, S_refcount, 4) < 0 || hold(self, pool, S_free, sizeof(Py_ssize_t)) < 0 ||
        hold(self, slots, S_tables, 4) < 0 || hold(self, slots, S_state, 1) < 0 ||
        hold(self, slots, S_prompt_len, 4) < 0 || hold(self, slots, S_prefix_tokens, 4) < 0 ||
        hold(self, slots, S_kv_len, 4) < 0 || hold(self, slots, S_num_pages, 4) < 0 ||
        hold(self, slots, S_serial, 8) < 0 || hold(self, slots, S_admission, 8) < 0)
        return -1;
    self->pages_len = self->buf[B_RC].len / 4; /* num_pages + 1 */
    if (self->buf[B_FS].len / (Py_ssize_t)sizeof(Py_ssize_t) != self->pages_len - 1 ||
        self->buf[B_TABLE].len / 4 != self->capacity * self->logical_pages ||
        self->buf[B_STATE].len != self->capacity) {
        PyErr_SetString(PyExc_ValueError, "pool or slot arrays of unexpected sizes");
        return -1;
    }
    if (self->store != NULL) {
        if (hold(self, store, S_run_py, 8) < 0 || hold(self, store, S_key_py, 8) < 0 ||
            hold(self, store, S_stamp, 8) < 0)
            return -1;
        if (self->buf[B_RUN].len / 8 != self->pages_len ||
            self->buf[B_STAMP].len / 8 != self->pages_len) {
            PyErr_SetString(PyExc_ValueError, "store arrays do not match the pool");
            return -1;
        }
    }
    PyObject *cleared = PyObject_GetAttr(slots, S_cleared);
    if (cleared == NULL) return -1;
    if (!PyList_Check(cleared) || PyList_GET_SIZE(cleared) > MAX_CLEARED) {
        Py_DECREF(cleared);
        PyErr_SetString(PyExc_TypeError, "slots._cleared: a list of at most 16 columns");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cleared); i++) {
        Py_buffer *view = &self->cleared[self->ncleared];
        if (PyObject_GetBuffer(PyList_GET_ITEM(cleared, i), view,
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(cleared);
            return -1;
        }
        self->ncleared++;
        Py_ssize_t size = view->itemsize;
        if ((size != 1 && size != 4 && size != 8) || view->len / size != self->capacity) {
            Py_DECREF(cleared);
            PyErr_SetString(PyExc_ValueError, "slots._cleared: a column of unexpected shape");
            return -1;
        }
    }
    Py_DECREF(cleared);
    return 0;
}

/* ---- the store's per-page steps (short.py / prefix.py's *_list) ------------------- */

/* Drop up to `want` of the oldest evictable entries into out[]; their pages keep the
 * store's one reference, which the caller takes over. The number dropped, or -1. */
static Py_ssize_t drop_oldest(Lives *self, Py_ssize_t want, Py_ssize_t *out) {
    int64_t *run = I64(self, B_RUN), *stamp = I64(self, B_STAMP);
    long long head, tail;
    if (get_ll(self->queue, S_head, &head) < 0 || get_ll(self->queue, S_tail, &tail) < 0)
        return -1;
    PyObject *pmv = PyObject_GetAttr(self->queue, S_pmv);
    if (pmv == NULL) return -1;
    PyObject *smv = PyObject_GetAttr(self->queue, S_smv);
    if (smv == NULL) { Py_DECREF(pmv); return -1; }
    Py_buffer pv, sv;
    if (PyObject_GetBuffer(pmv, &pv, PyBUF_C_CONTIGUOUS) < 0) goto fail_views;
    if (PyObject_GetBuffer(smv, &sv, PyBUF_C_CONTIGUOUS) < 0) { PyBuffer_Release(&pv); goto fail_views; }
    const Py_ssize_t *qp = (const Py_ssize_t *)pv.buf;
    const int64_t *qs = (const int64_t *)sv.buf;
    Py_ssize_t got = 0;
    while (got < want && head < tail) {
        Py_ssize_t page = qp[head];
        if (page > 0 && page < self->pages_len && stamp[page] == qs[head]) out[got++] = page;
        head++;
    }
    PyBuffer_Release(&pv);
    PyBuffer_Release(&sv);
    Py_DECREF(pmv);
    Py_DECREF(smv);
    for (Py_ssize_t i = 0; i < got; i++) {
        run[out[i]] = 0; /* its dict entry goes stale */
        stamp[out[i]] = 0;
    }
    if (set_ll(self->queue, S_head, head) < 0 || add_ll(self->store, S_entries, -got) < 0 ||
        add_ll(self->store, S_evictable, -got) < 0 ||
        add_ll(self->store, S_evicted_total, got) < 0)
        return -1;
    return got;
fail_views:
    Py_DECREF(pmv);
    Py_DECREF(smv);
    return -1;
}

/* Queue pages[0 .. n) stamped first, first + 1, ... (EvictionQueue.push_list). */
static int queue_push(Lives *self, const Py_ssize_t *pages, Py_ssize_t n, long long first) {
    long long tail;
    if (get_ll(self->queue, S_tail, &tail) < 0) return -1;
    for (int attempt = 0; attempt < 2; attempt++) {
        PyObject *pmv = PyObject_GetAttr(self->queue, S_pmv);
        if (pmv == NULL) return -1;
        PyObject *smv = PyObject_GetAttr(self->queue, S_smv);
        if (smv == NULL) { Py_DECREF(pmv); return -1; }
        Py_buffer pv, sv;
        int ok = PyObject_GetBuffer(pmv, &pv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0;
        if (ok && PyObject_GetBuffer(smv, &sv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&pv);
            ok = 0;
        }
        Py_DECREF(pmv);
        Py_DECREF(smv);
        if (!ok) return -1;
        if (tail + n <= pv.len / (Py_ssize_t)sizeof(Py_ssize_t)) {
            Py_ssize_t *qp = (Py_ssize_t *)pv.buf;
            int64_t *qs = (int64_t *)sv.buf;
            for (Py_ssize_t i = 0; i < n; i++) {
                qp[tail] = pages[i];
                qs[tail] = first + i;
                tail++;
            }
            PyBuffer_Release(&pv);
            PyBuffer_Release(&sv);
            return set_ll(self->queue, S_tail, tail);
        }
        PyBuffer_Release(&pv);
        PyBuffer_Release(&sv);
        if (attempt) break;
        /* Full: the queue drops its stale pairs and grows (Python; amortised O(1)). */
        PyObject *live = PyObject_GetAttr(self->store, S_live);
        if (live == NULL) return -1;
        PyObject *r = PyObject_CallMethod(self->queue, "_compact", "nO", n, live);
        Py_DECREF(live);
        if (r == NULL) return -1;
        Py_DECREF(r);
        if (get_ll(self->queue, S_tail, &tail) < 0) return -1;
    }
    PyErr_SetString(PyExc_SystemError, "eviction queue: no room after compaction");
    return -1;
}

/* ---- the slot table's take / clear ------------------------------------------------- */

static void clear_columns(Lives *self, long slot) {
    Py_ssize_t count = I32(self, B_NPAGES)[slot];
    int32_t *row = I32(self, B_TABLE) + (Py_ssize_t)slot * self->logical_pages;
    if (count > 0) memset(row, 0, (size_t)count * sizeof(int32_t));
    for (int i = 0; i < self->ncleared; i++) {
        Py_buffer *v = &self->cleared[i];
        memset((char *)v->buf + (Py_ssize_t)slot * v->itemsize, 0, (size_t)v->itemsize);
    }
    ((int8_t *)self->buf[B_STATE].buf)[slot] = 0; /* FREE */
}

/* SlotTable.clear: forget the request and return the slot to the free heap. */
static int clear_slot(Lives *self, long slot) {
    PyObject *rids = PyObject_GetAttr(self->slots, S_rids);
    if (rids == NULL) return -1;
    PyObject *keys = PyObject_GetAttr(self->slots, S_keys);
    if (keys == NULL) { Py_DECREF(rids); return -1; }
    int rc = -1;
    if (!PyList_CheckExact(rids) || !PyList_CheckExact(keys) || slot >= PyList_GET_SIZE(rids) ||
        slot >= PyList_GET_SIZE(keys)) {
        PyErr_SetString(PyExc_TypeError, "slots.rids / slots.keys: lists of capacity items");
        goto done;
    }
    PyObject *rid = PyList_GET_ITEM(rids, slot);
    if (rid != Py_None) {
        PyObject *index = PyObject_GetAttr(self->slots, S_index);
        if (index == NULL) goto done;
        int r = PyDict_DelItem(index, rid);
        Py_DECREF(index);
        if (r < 0) goto done;
    }
    Py_INCREF(Py_None);
    PyList_SetItem(rids, slot, Py_None);
    Py_INCREF(Py_None);
    PyList_SetItem(keys, slot, Py_None);
    clear_columns(self, slot);
    PyObject *heap = PyObject_GetAttr(self->slots, S_free_heap);
    if (heap == NULL) goto done;
    PyObject *s = PyLong_FromLong(slot);
    PyObject *r = s ? PyObject_CallFunctionObjArgs(heappush, heap, s, NULL) : NULL;
    Py_XDECREF(s);
    Py_DECREF(heap);
    if (r == NULL) goto done;
    Py_DECREF(r);
    rc = 0;
done:
    Py_DECREF(rids);
    Py_DECREF(keys);
    return rc;
}

/* ---- admit ------------------------------------------------------------------------- */

#define LOCAL_PAGES 256

static PyObject *Lives_admit(Lives *self, PyObject *const *args, Py_ssize_t nargs) {
    /* admit(sched, request_id, prompt_len, keys: list[int], state, headroom, need); sched:
     * the scheduler, whose admission counters go up */
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "admit takes 7 arguments");
        return NULL;
    }
    PyObject *sched = args[0];
    args++;
    PyObject *rid = args[0], *keys = args[2], *state_obj = args[3];
    long long prompt_len = PyLong_AsLongLong(args[1]);
    long long headroom = PyLong_AsLongLong(args[4]);
    long long need = PyLong_AsLongLong(args[5]);
    long state = PyLong_AsLong(state_obj);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(keys)) {
        PyErr_SetString(PyExc_TypeError, "admit: keys must be a list of ints");
        return NULL;
    }
    if (need < 1 || need > self->logical_pages || prompt_len < 1) {
        PyErr_SetString(PyExc_ValueError, "admit: need outside 1 .. logical_pages");
        return NULL;
    }
    int strict = pool_strict(self);
    if (strict < 0) return NULL;
    if (strict) Py_RETURN_NOTIMPLEMENTED;

    Py_ssize_t local[LOCAL_PAGES];
    Py_ssize_t *pages = need <= LOCAL_PAGES ? local : PyMem_Malloc((size_t)need * sizeof(Py_ssize_t));
    if (pages == NULL) return PyErr_NoMemory();
    PyObject *result = NULL, *slot_o = NULL;
    int32_t *rc = I32(self, B_RC);
    Py_ssize_t *fs = (Py_ssize_t *)self->buf[B_FS].buf;
    Py_ssize_t nkeys = PyList_GET_SIZE(keys), h = 0, n;

    /* The stored prefix: keys in the dict whose pages are still cached under them. The
     * prompt's last token is always recomputed, so at most (prompt_len - 1) // page_size. */
    long long limit = (prompt_len - 1) / self->page_size;
    if (self->store != NULL && nkeys && limit) {
        int64_t *run = I64(self, B_RUN);
        uint64_t *key = (uint64_t *)self->buf[B_KEY].buf;
        PyObject *page_of = PyObject_GetAttr(self->store, S_page_of);
        if (page_of == NULL) goto out;
        if (!PyDict_CheckExact(page_of)) {
            Py_DECREF(page_of);
            PyErr_SetString(PyExc_TypeError, "store._page_of must be a dict");
            goto out;
        }
        Py_ssize_t m = nkeys < limit ? nkeys : (Py_ssize_t)limit;
        if (m > need - 1) m = need - 1;
        for (Py_ssize_t i = 0; i < m; i++) {
            PyObject *k = PyList_GET_ITEM(keys, i);
            PyObject *p = PyDict_GetItemWithError(page_of, k); /* borrowed */
            if (p == NULL) {
                if (PyErr_Occurred()) { Py_DECREF(page_of); goto out; }
                break;
            }
            Py_ssize_t page = PyLong_AsSsize_t(p);
            if (page < 1 || page >= self->pages_len || !run[page]) { PyErr_Clear(); break; }
            unsigned long long kv = PyLong_AsUnsignedLongLong(k);
            if (kv == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(page_of); goto out; }
            if (key[page] != kv) break; /* a stale entry */
            pages[h++] = page;
        }
        Py_DECREF(page_of);
    }

    long long count = need - h, top, evictable = 0;
    if (get_ll(self->pool, S_top, &top) < 0) goto out;
    if (self->store != NULL && get_ll(self->store, S_evictable, &evictable) < 0) goto out;
    long long spare = top + evictable;
    /* The hits stop being evictable once held: counted only when the worst case misses. */
    if (count + headroom > spare - h) {
        long long lone = 0;
        for (Py_ssize_t i = 0; i < h; i++) lone += rc[pages[i]] == 1;
        if (count + headroom > spare - lone) {
            result = Py_None;
            Py_INCREF(result);
            goto out;
        }
    }
    if (h) {
        int64_t *stamp = I64(self, B_STAMP);
        long long lone = 0;
        for (Py_ssize_t i = 0; i < h; i++) {
            rc[pages[i]] += 1;
            if (stamp[pages[i]]) {
                stamp[pages[i]] = 0; /* was evictable: no longer */
                lone++;
            }
        }
        if (lone && set_ll(self->store, S_evictable, evictable - lone) < 0) goto out;
    }
    n = h;
    if (count > top) { /* evict the shortfall, oldest first: straight to this request */
        Py_ssize_t got = drop_oldest(self, (Py_ssize_t)(count - top), pages + n);
        if (got < 0) goto out;
        n += got;
        count -= got;
        if (count > top) {
            PyErr_SetString(PyExc_SystemError, "admit: eviction fell short of its promise");
            goto out;
        }
    }
    if (count) { /* fresh pages, the stack's top first */
        for (long long j = 0; j < count; j++) {
            Py_ssize_t page = fs[top - 1 - j];
            rc[page] = 1;
            pages[n++] = page;
        }
        if (set_ll(self->pool, S_top, top - count) < 0) goto out;
    }

    /* The slot: the lowest free one, a fresh serial (SlotTable.take). */
    {
        PyObject *heap = PyObject_GetAttr(self->slots, S_free_heap);
        if (heap == NULL) goto out;
        slot_o = PyObject_CallOneArg(heappop, heap);
        Py_DECREF(heap);
        if (slot_o == NULL) goto out;
    }
    long slot = PyLong_AsLong(slot_o);
    if (slot < 0 || slot >= self->capacity) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "free heap: bad slot");
        goto out;
    }
    long long serial;
    if (get_ll(self->slots, S_serials, &serial) < 0 || set_ll(self->slots, S_serials, ++serial) < 0)
        goto out;
    I64(self, B_SERIAL)[slot] = I64(self, B_ADMISSION)[slot] = serial;
    {
        PyObject *rids = PyObject_GetAttr(self->slots, S_rids);
        if (rids == NULL) goto out;
        Py_INCREF(rid);
        int r = PyList_SetItem(rids, slot, rid);
        Py_DECREF(rids);
        if (r < 0) goto out;
        PyObject *index = PyObject_GetAttr(self->slots, S_index);
        if (index == NULL) goto out;
        r = PyDict_SetItem(index, rid, slot_o);
        Py_DECREF(index);
        if (r < 0) goto out;
    }
    int32_t *row = I32(self, B_TABLE) + (Py_ssize_t)slot * self->logical_pages;
    for (Py_ssize_t i = 0; i < n; i++) row[i] = (int32_t)pages[i];
    long long prefix = h * self->page_size;
    I32(self, B_NPAGES)[slot] = (int32_t)need;
    I32(self, B_PROMPT)[slot] = (int32_t)prompt_len;
    I32(self, B_PREFIX)[slot] = I32(self, B_KV)[slot] = (int32_t)prefix;
    {
        PyObject *skeys = PyObject_GetAttr(self->slots, S_keys);
        if (skeys == NULL) goto out;
        PyObject *kept = nkeys ? keys : Py_None;
        Py_INCREF(kept);
        int r = PyList_SetItem(skeys, slot, kept);
        Py_DECREF(skeys);
        if (r < 0) goto out;
    }
    ((int8_t *)self->buf[B_STATE].buf)[slot] = (int8_t)state;
    if (add_ll(sched, S_admissions, 1) < 0 || add_ll(sched, S_prompt_tokens, prompt_len) < 0 ||
        add_ll(sched, S_hit_tokens, prefix) < 0)
        goto out;

    {
        PyObject *list = PyList_New(n);
        if (list == NULL) goto out;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyLong_FromSsize_t(pages[i]);
            if (v == NULL) { Py_DECREF(list); goto out; }
            PyList_SET_ITEM(list, i, v);
        }
        PyObject *serial_o = PyLong_FromLongLong(serial);
        PyObject *prefix_o = PyLong_FromLongLong(prefix);
        PyObject *h_o = PyLong_FromSsize_t(h);
        if (serial_o && prefix_o && h_o) {
            PyObject *argv[8] = {rid, slot_o, serial_o, state_obj, args[1], prefix_o, list, h_o};
            result = PyObject_Vectorcall(self->admission_type, argv, 8, NULL);
        }
        Py_XDECREF(serial_o);
        Py_XDECREF(prefix_o);
        Py_XDECREF(h_o);
        Py_DECREF(list);
    }
out:
    Py_XDECREF(slot_o);
    if (pages != local) PyMem_Free(pages);
    return result;
}

/* ---- complete ---------------------------------------------------------------------- */

/* PrefixKvStore.insert_list of the slot's keys and its table's first pages. */
static int insert_keys(Lives *self, PyObject *keys, const int32_t *row) {
    Py_ssize_t n = PyList_GET_SIZE(keys), skip = 0;
    int64_t *run = I64(self, B_RUN);
    uint64_t *key = (uint64_t *)self->buf[B_KEY].buf;
    int32_t *rc = I32(self, B_RC);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (row[i] < 1 || row[i] >= self->pages_len) {
            PyErr_SetString(PyExc_SystemError, "complete: a page id outside the pool");
            return -1;
        }
    }
    while (skip < n && run[row[skip]]) skip++; /* the prefix hit: entries already */
    if (skip == n) return 0;
    long long entries, max_entries;
    if (get_ll(self->store, S_entries, &entries) < 0 ||
        get_ll(self->store, S_max_entries, &max_entries) < 0)
        return -1;
    if (n - skip > max_entries - entries) { /* must evict to fit: the array path */
        PyObject *plist = PyList_New(n);
        if (plist == NULL) return -1;
        for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(plist, i, PyLong_FromLong(row[i]));
        PyObject *meth = PyObject_GetAttr(self->store, S_insert);
        PyObject *kw = meth ? Py_BuildValue("{O:O}", S_trusted, Py_True) : NULL;
        PyObject *a = kw ? PyTuple_Pack(2, keys, plist) : NULL;
        PyObject *r = a ? PyObject_Call(meth, a, kw) : NULL;
        Py_XDECREF(a);
        Py_XDECREF(kw);
        Py_XDECREF(meth);
        Py_DECREF(plist);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    PyObject *page_of = PyObject_GetAttr(self->store, S_page_of);
    if (page_of == NULL) return -1;
    if (!PyDict_CheckExact(page_of)) {
        Py_DECREF(page_of);
        PyErr_SetString(PyExc_TypeError, "store._page_of must be a dict");
        return -1;
    }
    long long run_ids;
    if (get_ll(self->store, S_run_ids, &run_ids) < 0) { Py_DECREF(page_of); return -1; }
    long long run_id = run_ids + 1;
    Py_ssize_t added = 0;
    for (Py_ssize_t i = skip; i < n; i++) {
        Py_ssize_t page = row[i];
        if (run[page]) continue; /* cached under another key */
        PyObject *k = PyList_GET_ITEM(keys, i);
        unsigned long long kv = PyLong_AsUnsignedLongLong(k);
        if (kv == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(page_of); return -1; }
        PyObject *old = PyDict_GetItemWithError(page_of, k);
        if (old == NULL && PyErr_Occurred()) { Py_DECREF(page_of); return -1; }
        if (old != NULL) {
            Py_ssize_t op = PyLong_AsSsize_t(old);
            if (op > 0 && op < self->pages_len && run[op] && key[op] == kv)
                continue; /* the key is stored (its page stays; ours stays private) */
            PyErr_Clear();
        }
        PyObject *p = PyLong_FromSsize_t(page);
        if (p == NULL || PyDict_SetItem(page_of, k, p) < 0) { /* replaces a stale entry */
            Py_XDECREF(p);
            Py_DECREF(page_of);
            return -1;
        }
        Py_DECREF(p);
        run[page] = run_id;
        key[page] = kv;
        rc[page] += 1;
        added++;
    }
    Py_ssize_t dict_len = PyDict_GET_SIZE(page_of);
    Py_DECREF(page_of);
    if (!added) return 0;
    /* The run's keys and pages (chain order): every key past the hit, or the added ones. */
    PyObject *new_keys = PyList_New(added), *new_pages = PyList_New(added);
    if (new_keys == NULL || new_pages == NULL) goto fail_lists;
    for (Py_ssize_t i = skip, j = 0; i < n; i++) {
        if (run[row[i]] != run_id) continue;
        PyObject *k = PyList_GET_ITEM(keys, i);
        PyObject *p = PyLong_FromLong(row[i]);
        if (p == NULL) goto fail_lists;
        Py_INCREF(k);
        PyList_SET_ITEM(new_keys, j, k);
        PyList_SET_ITEM(new_pages, j, p);
        j++;
    }
    PyObject *runs = PyObject_GetAttr(self->store, S_runs);
    PyObject *pair = runs ? PyTuple_Pack(2, new_keys, new_pages) : NULL;
    PyObject *rid_o = pair ? PyLong_FromLongLong(run_id) : NULL;
    int r = rid_o ? PyDict_SetItem(runs, rid_o, pair) : -1;
    Py_XDECREF(rid_o);
    Py_XDECREF(pair);
    Py_XDECREF(runs);
    Py_DECREF(new_keys);
    Py_DECREF(new_pages);
    if (r < 0) return -1;
    long long run_entries, sweep_at, size;
    if (set_ll(self->store, S_run_ids, run_id) < 0 ||
        set_ll(self->store, S_entries, entries + added) < 0 ||
        get_ll(self->store, S_run_entries, &run_entries) < 0 ||
        set_ll(self->store, S_run_entries, run_entries + added) < 0 ||
        get_ll(self->store, S_sweep_at, &sweep_at) < 0 || get_ll(self->store, S_size, &size) < 0)
        return -1;
    if (run_entries + added > sweep_at) {
        PyObject *x = PyObject_CallMethodNoArgs(self->store, S_sweep);
        if (x == NULL) return -1;
        Py_DECREF(x);
    }
    if (dict_len > entries + added + self->stale_factor * size) {
        PyObject *x = PyObject_CallMethodNoArgs(self->store, S_rebuild_map);
        if (x == NULL) return -1;
        Py_DECREF(x);
    }
    return 0;
fail_lists:
    Py_XDECREF(new_keys);
    Py_XDECREF(new_pages);
    return -1;
}

static PyObject *Lives_complete(Lives *self, PyObject *arg) {
    /* complete(slot): the prompt's KV is all written; its full pages go to the store. */
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= self->capacity) {
        PyErr_SetString(PyExc_IndexError, "complete: slot out of range");
        return NULL;
    }
    PyObject *skeys = PyObject_GetAttr(self->slots, S_keys);
    if (skeys == NULL) return NULL;
    if (!PyList_CheckExact(skeys) || slot >= PyList_GET_SIZE(skeys)) {
        Py_DECREF(skeys);
        PyErr_SetString(PyExc_TypeError, "slots.keys: a list of capacity items");
        return NULL;
    }
    PyObject *keys = PyList_GET_ITEM(skeys, slot);
    if (keys != Py_None) {
        int strict = pool_strict(self);
        if (strict < 0) { Py_DECREF(skeys); return NULL; }
        if (strict || !PyList_CheckExact(keys)) { /* checked, or a long prompt's array */
            Py_DECREF(skeys);
            Py_RETURN_NOTIMPLEMENTED;
        }
        if (PyList_GET_SIZE(keys) > self->logical_pages) {
            Py_DECREF(skeys);
            PyErr_SetString(PyExc_ValueError, "complete: more keys than table entries");
            return NULL;
        }
    }
    int32_t *kv = I32(self, B_KV), *prompt = I32(self, B_PROMPT);
    kv[slot] = prompt[slot];
    if (keys != Py_None) {
        if (self->store != NULL) {
            Py_INCREF(keys);
            int r = insert_keys(self, keys, I32(self, B_TABLE) + (Py_ssize_t)slot * self->logical_pages);
            Py_DECREF(keys);
            if (r < 0) { Py_DECREF(skeys); return NULL; }
        }
        Py_INCREF(Py_None);
        PyList_SetItem(skeys, slot, Py_None);
    }
    Py_DECREF(skeys);
    ((int8_t *)self->buf[B_STATE].buf)[slot] = 3; /* PREFILLED */
    Py_RETURN_NONE;
}

/* ---- finish ------------------------------------------------------------------------ */

static PyObject *Lives_finish(Lives *self, PyObject *arg) {
    /* finish(slot): release the slot's pages (recency stamped root-newest, freed pages back
     * on the stack in table order) and free the slot. */
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= self->capacity) {
        PyErr_SetString(PyExc_IndexError, "finish: slot out of range");
        return NULL;
    }
    int strict = pool_strict(self);
    if (strict < 0) return NULL;
    if (strict) Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t count = I32(self, B_NPAGES)[slot];
    if (count < 0 || count > self->logical_pages) {
        PyErr_SetString(PyExc_SystemError, "finish: bad page count");
        return NULL;
    }
    const int32_t *row = I32(self, B_TABLE) + (Py_ssize_t)slot * self->logical_pages;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (row[i] < 1 || row[i] >= self->pages_len) {
            PyErr_SetString(PyExc_SystemError, "finish: a page id outside the pool");
            return NULL;
        }
    }
    Py_ssize_t local[2 * LOCAL_PAGES];
    Py_ssize_t *freed = count <= LOCAL_PAGES ? local : PyMem_Malloc(2 * (size_t)count * sizeof(Py_ssize_t));
    if (freed == NULL) return PyErr_NoMemory();
    Py_ssize_t *lone = freed + count, nfreed = 0, nlone = 0;
    int32_t *rc = I32(self, B_RC);
    int64_t *run = self->store != NULL ? I64(self, B_RUN) : NULL;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t page = row[i];
        int32_t c = --rc[page];
        if (!c)
            freed[nfreed++] = page;
        else if (c == 1 && run != NULL && run[page])
            lone[nlone++] = page; /* cached and held by the store alone now: evictable */
    }
    if (nlone) { /* leaf first into the queue: the root gets the newest stamp */
        long long clock;
        int64_t *stamp = I64(self, B_STAMP);
        if (get_ll(self->store, S_clock, &clock) < 0 ||
            set_ll(self->store, S_clock, clock + nlone) < 0)
            goto out;
        for (Py_ssize_t i = 0; i < nlone; i++) stamp[lone[i]] = clock + nlone - i;
        for (Py_ssize_t i = 0, j = nlone - 1; i < j; i++, j--) {
            Py_ssize_t t = lone[i];
            lone[i] = lone[j];
            lone[j] = t;
        }
        if (queue_push(self, lone, nlone, clock + 1) < 0 ||
            add_ll(self->store, S_evictable, nlone) < 0)
            goto out;
    }
    if (nfreed) { /* the next allocation pops them in table order */
        long long top;
        Py_ssize_t *fs = (Py_ssize_t *)self->buf[B_FS].buf;
        if (get_ll(self->pool, S_top, &top) < 0) goto out;
        for (Py_ssize_t i = nfreed - 1; i >= 0; i--) fs[top++] = freed[i];
        if (set_ll(self->pool, S_top, top) < 0) goto out;
    }
    if (clear_slot(self, slot) < 0) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    if (freed != local) PyMem_Free(freed);
    return result;
}

/* ---- the type and the module -------------------------------------------------------- */

static PyMethodDef Lives_methods[] = {
    {"admit", (PyCFunction)(void (*)(void))Lives_admit, METH_FASTCALL,
     "admit(sched, request_id, prompt_len, keys, state, headroom, need) -> Admission | None | "
     "NotImplemented: short.py's _admit_short, compiled (NotImplemented: a strict pool)"},
    {"complete", (PyCFunction)Lives_complete, METH_O,
     "complete(slot) -> None | NotImplemented: the prompt's completion (NotImplemented: a "
     "strict pool or a long prompt's key array)"},
    {"finish", (PyCFunction)Lives_finish, METH_O,
     "finish(slot) -> None | NotImplemented: short.py's _finish_short, compiled"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LivesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tspd_core.sched._lives.Lives",
    .tp_basicsize = sizeof(Lives),
    .tp_dealloc = (destructor)Lives_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Lives(pool, store, slots, admission, page_size): a scheduler's short "
              "request lives, compiled (see tspd_core.sched.short)",
    .tp_methods = Lives_methods,
    .tp_init = (initproc)Lives_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef lives_module = {
    PyModuleDef_HEAD_INIT, "_lives",
    "Short request lives, compiled (see tspd_core.sched.short).", -1, NULL,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__lives(void) {
    INTERN(S_top, "_top"); INTERN(S_strict, "strict"); INTERN(S_page_of, "_page_of");
    INTERN(S_evictable, "_evictable"); INTERN(S_clock, "_clock"); INTERN(S_entries, "_entries");
    INTERN(S_run_ids, "_run_ids"); INTERN(S_runs, "_runs"); INTERN(S_run_entries, "_run_entries");
    INTERN(S_sweep_at, "_sweep_at"); INTERN(S_size, "_size"); INTERN(S_max_entries, "_max_entries");
    INTERN(S_evicted_total, "evicted_total"); INTERN(S_head, "_head"); INTERN(S_tail, "_tail");
    INTERN(S_pmv, "_pmv"); INTERN(S_smv, "_smv"); INTERN(S_compact, "_compact");
    INTERN(S_live, "_live"); INTERN(S_sweep, "_sweep"); INTERN(S_rebuild_map, "_rebuild_map");
    INTERN(S_insert, "insert"); INTERN(S_trusted, "trusted"); INTERN(S_free_heap, "free_heap");
    INTERN(S_serials, "_serials"); INTERN(S_rids, "rids"); INTERN(S_index, "index");
    INTERN(S_keys, "keys"); INTERN(S_admissions, "_admissions");
    INTERN(S_prompt_tokens, "_prompt_tokens"); INTERN(S_hit_tokens, "_hit_tokens");
    INTERN(S_queue, "_queue"); INTERN(S_refcount, "_refcount"); INTERN(S_free, "_free");
    INTERN(S_tables, "tables"); INTERN(S_state, "state"); INTERN(S_prompt_len, "prompt_len");
    INTERN(S_prefix_tokens, "prefix_tokens"); INTERN(S_kv_len, "kv_len");
    INTERN(S_num_pages, "num_pages"); INTERN(S_serial, "serial"); INTERN(S_admission, "admission");
    INTERN(S_run_py, "_run_py"); INTERN(S_key_py, "_key_py"); INTERN(S_stamp, "_stamp");
    INTERN(S_cleared, "_cleared"); INTERN(S_logical_pages, "logical_pages");
    INTERN(S_capacity, "capacity"); INTERN(S_STALE, "_STALE_FACTOR");
    PyObject *heapq = PyImport_ImportModule("heapq");
    if (heapq == NULL) return NULL;
    heappop = PyObject_GetAttrString(heapq, "heappop");
    heappush = PyObject_GetAttrString(heapq, "heappush");
    Py_DECREF(heapq);
    if (heappop == NULL || heappush == NULL) return NULL;
    if (PyType_Ready(&LivesType) < 0) return NULL;
    PyObject *m = PyModule_Create(&lives_module);
    if (m == NULL) return NULL;
    Py_INCREF(&LivesType);
    if (PyModule_AddObject(m, "Lives", (PyObject *)&LivesType) < 0) {
        Py_DECREF(&LivesType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
