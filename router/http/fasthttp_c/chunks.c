/* router.http._fasthttp.scan_chunks: a chunked body's common case (router/http/client.py keeps the reference).

scan_chunks(data, pos) -> (pos, payload)
    From `pos`, at the start of a chunk-size line of a chunked body, takes every complete chunk in the canonical
    form `HEXDIG{1,15} CRLF data CRLF` with a size above 0, and returns the position after the last one taken with
    their data joined. It stops, leaving the rest to the Python loop, at the first line that is anything else:
    the last chunk (size 0), a chunk extension, whitespace or any other byte in the size line, a chunk not yet
    whole, data not followed by CRLF. So the Python loop stays the one definition of every case but the common
    one, and a body decodes the same with or without this module (tests/router/test_h1client.py holds them
    together). In Python that loop cost about 1.3 us a chunk; a streamed answer is one chunk per token. */
#include "fasthttp.h"

#include <string.h>

#define MAX_DIGITS 15 /* 2^60: a larger size is left to Python, whose int has no bound */

static int hex_value(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The data of the canonical chunk at `*pos` (its offset and size), advancing `*pos` past it; 0 when none. */
static int next_chunk(const unsigned char *s, Py_ssize_t n, Py_ssize_t *pos, Py_ssize_t *at, Py_ssize_t *size)
{
    Py_ssize_t p = *pos, v = 0;
    int digits = 0, h;
    while (p < n && (h = hex_value(s[p])) >= 0) {
        if (++digits > MAX_DIGITS)
            return 0;
        v = (v << 4) | h;
        p++;
    }
    if (digits == 0 || v == 0 || n - p < 2 || s[p] != '\r' || s[p + 1] != '\n')
        return 0;
    p += 2;
    if (v > n - p || n - p - v < 2 || s[p + v] != '\r' || s[p + v + 1] != '\n')
        return 0;
    *at = p;
    *size = v;
    *pos = p + v + 2;
    return 1;
}

PyObject *py_scan_chunks(PyObject *Py_UNUSED(self), PyObject *args)
{
    const char *data;
    Py_ssize_t n, start;
    if (!PyArg_ParseTuple(args, "y#n:scan_chunks", &data, &n, &start))
        return NULL;
    if (start < 0 || start > n)
        return PyErr_Format(PyExc_ValueError, "scan_chunks: pos %zd outside 0..%zd", start, n);
    const unsigned char *s = (const unsigned char *)data;
    Py_ssize_t pos = start, at, size, total = 0;
    while (next_chunk(s, n, &pos, &at, &size))
        total += size;
    PyObject *payload = PyBytes_FromStringAndSize(NULL, total);
    if (payload == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(payload);
    Py_ssize_t end = pos;
    pos = start;
    while (pos < end && next_chunk(s, n, &pos, &at, &size)) {
        memcpy(out, s + at, (size_t)size);
        out += size;
    }
    return Py_BuildValue("(nN)", end, payload);
}
