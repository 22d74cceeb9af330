# cython: language_level=3, boundscheck=False, wraparound=False
"""Row copies for D's scatter: many equal rows between two host buffers, optionally with
non-temporal (streaming) stores.

D's scatter writes each staged piece once into pages nobody reads until the request decodes;
those pages are cold. A plain copy (``memcpy``, numpy's ``copyto``) first reads every cache
line it writes ("read for ownership") and leaves the piece's bytes in the cache, evicting
what the TCP receive copy of the next piece is about to use. Streaming stores (SSE2's
``movntdq``, on every x86-64) write around the cache: measured here, 8 MiB of 1 KiB rows at a
2 KiB stride into cold pages moved at 6-7 GB/s by ``memcpy`` or numpy and 18-24 GB/s
streamed. Where SSE2 is missing (another architecture) the streamed copy is a ``memcpy``.

The functions take raw addresses (``data_ptr()``, ``ndarray.ctypes.data``): the caller
checks that every row lies inside its buffers (:mod:`tspd_core.pd.transfer.byterows`). They
release the GIL while copying and end streamed copies with a store fence, so the bytes are
visible to any thread that learns of the copy afterwards.
"""

from libc.stdint cimport int64_t, uint8_t, uintptr_t

from tspd_core.sched._build import check_built_from

cdef extern from *:
    """
    #ifndef TSPD_SOURCE_SHA256
    #define TSPD_SOURCE_SHA256 ""
    #endif
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    /* One row: the bytes before the first 16-byte boundary of dst by memcpy, then 64 bytes
       at a time (unaligned loads, streaming stores), then 16 at a time, the rest by memcpy. */
    static void tspd_stream_row(uint8_t *dst, const uint8_t *src, size_t n) {
        size_t head = (size_t)(-(uintptr_t)dst) & 15u;
        if (head > n) head = n;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        while (n >= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            dst += 64; src += 64; n -= 64;
        }
        while (n >= 16) {
            _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
            dst += 16; src += 16; n -= 16;
        }
        memcpy(dst, src, n);
    }
    static void tspd_fence(void) { _mm_sfence(); }
    static const int TSPD_STREAMS = 1;
    #else
    static void tspd_stream_row(uint8_t *dst, const uint8_t *src, size_t n) {
        memcpy(dst, src, n);
    }
    static void tspd_fence(void) {}
    static const int TSPD_STREAMS = 0;
    #endif
    """
    const char *TSPD_SOURCE_SHA256
    const int TSPD_STREAMS
    void tspd_stream_row(uint8_t *dst, const uint8_t *src, size_t n) noexcept nogil
    void tspd_fence() noexcept nogil
    void *memcpy(void *dst, const void *src, size_t n) noexcept nogil

check_built_from(
    __file__, "_rowcopy", TSPD_SOURCE_SHA256.decode("ascii"), "tspd_core.pd.transfer"
)

#: Whether the streamed copies really stream here (SSE2), else they are memcpy.
STREAMS = bool(TSPD_STREAMS)


def copy_strided(
    uintptr_t dst, int64_t dst_step, uintptr_t src, int64_t src_step,
    int64_t count, int64_t length, bint stream,
):
    """Copy ``count`` rows of ``length`` bytes: row ``i`` from ``src + i * src_step`` to
    ``dst + i * dst_step`` (``stream``: with streaming stores, then a fence)."""
    cdef int64_t i
    if count < 0 or length < 0:
        raise ValueError(f"copy_strided of {count} rows of {length} bytes")
    with nogil:
        if stream:
            for i in range(count):
                tspd_stream_row(<uint8_t *>(dst + i * dst_step),
                                <const uint8_t *>(src + i * src_step), <size_t>length)
            tspd_fence()
        else:
            for i in range(count):
                memcpy(<void *>(dst + i * dst_step), <const void *>(src + i * src_step),
                       <size_t>length)


def copy_rows(uintptr_t dst, uintptr_t rows, uintptr_t src, int64_t count, int64_t size,
              bint stream):
    """Copy ``count`` consecutive rows of ``size`` bytes from ``src`` to the rows of ``dst``
    numbered by the ``count`` int64 values at ``rows``: source row ``i`` goes to
    ``dst + rows[i] * size`` (``stream``: with streaming stores, then a fence)."""
    cdef int64_t i
    cdef const int64_t *index = <const int64_t *>rows
    if count < 0 or size < 0:
        raise ValueError(f"copy_rows of {count} rows of {size} bytes")
    with nogil:
        if stream:
            for i in range(count):
                tspd_stream_row(<uint8_t *>(dst + index[i] * size),
                                <const uint8_t *>(src + i * size), <size_t>size)
            tspd_fence()
        else:
            for i in range(count):
                memcpy(<void *>(dst + index[i] * size), <const void *>(src + i * size),
                       <size_t>size)
