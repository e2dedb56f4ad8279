/* router._fasthttp.request_head and response_head: the common case of the heads the lean listener and the lean
client read (router/lean.py's parse_head and router/h1client.py's response head parse are the reference).

request_head(head) -> (chat, [(name, value)], content_length, close), or None
    `head`: the request line and header lines without the blank line. Takes only a plain generation request in the
    form parse_head accepts: `POST /v1/completions HTTP/1.1` (or /v1/chat/completions), at most MAX_LINES lines,
    each header a token, a colon and a value of tab and visible ASCII (stripped of spaces and tabs), one
    Content-Length of 1-15 digits; a Connection header's tokens read for `close` (`upgrade`: None). Anything else,
    including every head parse_head refuses and every header it hands over (Transfer-Encoding, Content-Encoding,
    Expect, Upgrade), is None: parse_head then decides.

response_head(head) -> (status, http_1_0, [(name, value)]), or None
    Takes a status line `HTTP/1.1 DDD ...` or `HTTP/1.0 DDD ...` and header lines of a token, a colon and a value of
    tab and visible ASCII (stripped of spaces and tabs). Anything else is None: the Python parse decides (it also
    reads UTF-8 values, and raises on a malformed head).

In Python, parse_head took 7 us on an OpenAI client's head of eight headers; the pairs become a CIMultiDict in
one call. */
#include "fasthttp.h"

#include <string.h>

#define MAX_LINES 101 /* router.lean.MAX_HEADERS + the request line */

static unsigned char token_char[256], value_char[256];

static void init_tables(void)
{
    static int done = 0;
    if (done)
        return;
    const char *tchars = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    for (const char *c = tchars; *c; c++)
        token_char[(unsigned char)*c] = 1;
    value_char['\t'] = 1;
    for (int c = 0x20; c < 0x7f; c++)
        value_char[c] = 1;
    done = 1;
}

/* Case-insensitive equality of s[0..n) and the lower-case `word`. */
static int is_word(const char *s, Py_ssize_t n, const char *word)
{
    Py_ssize_t w = (Py_ssize_t)strlen(word);
    if (n != w)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 'A' && c <= 'Z')
            c += 'a' - 'A';
        if (c != (unsigned char)word[i])
            return 0;
    }
    return 1;
}

/* One header line [s, e): its name [s, colon) and its value stripped of spaces and tabs [*vs, *ve); 0 when it is not
   a token, a colon and tab and visible ASCII. */
static int header_line(const char *s, const char *e, const char **colon, const char **vs, const char **ve)
{
    const char *p = s;
    while (p < e && token_char[(unsigned char)*p])
        p++;
    if (p == s || p == e || *p != ':')
        return 0;
    *colon = p;
    const char *v = p + 1;
    for (const char *q = v; q < e; q++)
        if (!value_char[(unsigned char)*q])
            return 0;
    while (v < e && (*v == ' ' || *v == '\t'))
        v++;
    const char *w = e;
    while (w > v && (w[-1] == ' ' || w[-1] == '\t'))
        w--;
    *vs = v;
    *ve = w;
    return 1;
}

/* The end of the line starting at s (its "\r\n", or the head's end). */
static const char *line_end(const char *s, const char *end)
{
    const char *p = s;
    while (p + 1 < end && !(p[0] == '\r' && p[1] == '\n'))
        p++;
    return p + 1 < end ? p : end;
}

static int append_pair(PyObject *pairs, const char *ns, Py_ssize_t nn, const char *vs, Py_ssize_t vn)
{
    PyObject *pair = Py_BuildValue("(s#s#)", ns, nn, vs, vn);
    if (pair == NULL)
        return -1;
    int rc = PyList_Append(pairs, pair);
    Py_DECREF(pair);
    return rc;
}

/* Reads a Connection value's comma-separated tokens: *close when one is `close`; 0 when one is `upgrade`. */
static int connection_tokens(const char *s, const char *e, int *close)
{
    while (s <= e) {
        const char *c = s;
        while (c < e && *c != ',')
            c++;
        const char *a = s, *b = c;
        while (a < b && (*a == ' ' || *a == '\t'))
            a++;
        while (b > a && (b[-1] == ' ' || b[-1] == '\t'))
            b--;
        if (is_word(a, b - a, "upgrade"))
            return 0;
        if (is_word(a, b - a, "close"))
            *close = 1;
        s = c + 1;
    }
    return 1;
}

static const char POST_COMPLETIONS[] = "POST /v1/completions HTTP/1.1";
static const char POST_CHAT[] = "POST /v1/chat/completions HTTP/1.1";

PyObject *py_request_head(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*:request_head", &buf))
        return NULL;
    init_tables();
    const char *s = buf.buf, *end = s + buf.len;
    PyObject *pairs = NULL, *result = NULL;
    const char *e = line_end(s, end);
    int chat;
    if (e - s == (Py_ssize_t)sizeof(POST_COMPLETIONS) - 1 && !memcmp(s, POST_COMPLETIONS, (size_t)(e - s)))
        chat = 0;
    else if (e - s == (Py_ssize_t)sizeof(POST_CHAT) - 1 && !memcmp(s, POST_CHAT, (size_t)(e - s)))
        chat = 1;
    else
        goto defer;
    pairs = PyList_New(0);
    if (pairs == NULL)
        goto done;
    long long length = -1;
    int close = 0, lines = 1;
    while (e < end) {
        s = e + 2;
        e = line_end(s, end);
        if (++lines > MAX_LINES)
            goto defer;
        const char *colon, *vs, *ve;
        if (!header_line(s, e, &colon, &vs, &ve))
            goto defer;
        Py_ssize_t nn = colon - s;
        if (is_word(s, nn, "transfer-encoding") || is_word(s, nn, "content-encoding") || is_word(s, nn, "expect") ||
            is_word(s, nn, "upgrade"))
            goto defer;
        if (is_word(s, nn, "content-length")) {
            if (length >= 0 || ve == vs || ve - vs > 15)
                goto defer;
            long long v = 0;
            for (const char *p = vs; p < ve; p++) {
                if (*p < '0' || *p > '9')
                    goto defer;
                v = v * 10 + (*p - '0');
            }
            length = v;
        } else if (is_word(s, nn, "connection")) {
            if (!connection_tokens(vs, ve, &close))
                goto defer;
        }
        if (append_pair(pairs, s, nn, vs, ve - vs) < 0)
            goto done;
    }
    if (length < 0)
        goto defer;
    result = Py_BuildValue("(OOLO)", chat ? Py_True : Py_False, pairs, length, close ? Py_True : Py_False);
    goto done;
defer:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(pairs);
    PyBuffer_Release(&buf);
    return result;
}

PyObject *py_response_head(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*:response_head", &buf))
        return NULL;
    init_tables();
    const char *s = buf.buf, *end = s + buf.len;
    PyObject *pairs = NULL, *result = NULL;
    const char *e = line_end(s, end);
    /* "HTTP/1.x DDD", then the line's end or a space and the reason */
    if (e - s < 12 || memcmp(s, "HTTP/1.", 7) || (s[7] != '1' && s[7] != '0') || s[8] != ' ' ||
        (e - s > 12 && s[12] != ' '))
        goto defer;
    int status = 0;
    for (int i = 9; i < 12; i++) {
        if (s[i] < '0' || s[i] > '9')
            goto defer;
        status = status * 10 + (s[i] - '0');
    }
    int http10 = s[7] == '0';
    pairs = PyList_New(0);
    if (pairs == NULL)
        goto done;
    while (e < end) {
        s = e + 2;
        e = line_end(s, end);
        const char *colon, *vs, *ve;
        if (!header_line(s, e, &colon, &vs, &ve))
            goto defer;
        if (append_pair(pairs, s, colon - s, vs, ve - vs) < 0)
            goto done;
    }
    result = Py_BuildValue("(iOO)", status, http10 ? Py_True : Py_False, pairs);
    goto done;
defer:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(pairs);
    PyBuffer_Release(&buf);
    return result;
}
