/* router.http._fasthttp.request_head and response_head: the common case of the heads the lean listener and the lean
client read (router/http/server.py's parse_head and router/http/client.py's response head parse are the reference).

request_head(head) -> (chat, [(name, value)], content_length, close), or None
    `head`: the request line and header lines without the blank line. Takes only a plain generation request in the
    form parse_head accepts: `POST /v1/completions HTTP/1.1` (or /v1/chat/completions), at most MAX_LINES lines,
    each header a token, a colon and a value of tab and visible ASCII (stripped of spaces and tabs), one
    Content-Length of 1-15 digits; a Connection header's tokens read for `close` (`upgrade`: None). Anything else,
    including every head parse_head refuses and every header it hands over (Transfer-Encoding, Content-Encoding,
    Expect, Upgrade), is None: parse_head then decides.

response_head(head) -> (status, http_1_0, [(name, value)]), or None
    Takes a status line `HTTP/1.1 DDD ...` or `HTTP/1.0 DDD ...` with a final status of 200-599 and a reason of tab
    and visible ASCII, and at most MAX_RESPONSE_LINES header lines of a token, a colon and a value of tab and
    visible ASCII (stripped of spaces and tabs). Anything else is None: the Python parse decides (it also reads
    UTF-8 values and interim 100 and 103 heads, and raises on a malformed head: another status, a control byte, too
    many lines).

In Python, parse_head took 7 us on an OpenAI client's head of eight headers; the pairs become a CIMultiDict in
one call. */
#include "fasthttp.h"

#include <string.h>

#define MAX_LINES 101 /* router.http.server.MAX_HEADERS + the request line */
#define MAX_RESPONSE_LINES 100 /* router.http.client.MAX_RESPONSE_HEADERS */

static unsigned char token_char[256], value_char[256];

void heads_init(void)
{
    const char *tchars = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    for (const char *c = tchars; *c; c++)
        token_char[(unsigned char)*c] = 1;
    value_char['\t'] = 1;
    for (int c = 0x20; c < 0x7f; c++)
        value_char[c] = 1;
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

/* The header line after the line ending at *e: 1 with its name [*s, *colon) and value [*vs, *ve), advancing *s and
   *e to it; 0 at the head's end; -1 when the line is not a token, a colon and tab and visible ASCII. */
static int next_header(const char **s, const char **e, const char *end, const char **colon, const char **vs,
                       const char **ve)
{
    if (*e >= end)
        return 0;
    *s = *e + 2;
    *e = line_end(*s, end);
    return header_line(*s, *e, colon, vs, ve) ? 1 : -1;
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

/* None: the Python parse decides. */
static PyObject *defer(PyObject *pairs)
{
    Py_XDECREF(pairs);
    Py_RETURN_NONE;
}

static PyObject *request_head(const char *s, const char *end)
{
    const char *e = line_end(s, end);
    int chat;
    if (e - s == (Py_ssize_t)sizeof(POST_COMPLETIONS) - 1 && !memcmp(s, POST_COMPLETIONS, (size_t)(e - s)))
        chat = 0;
    else if (e - s == (Py_ssize_t)sizeof(POST_CHAT) - 1 && !memcmp(s, POST_CHAT, (size_t)(e - s)))
        chat = 1;
    else
        return defer(NULL);
    PyObject *pairs = PyList_New(0);
    if (pairs == NULL)
        return NULL;
    long long length = -1;
    int close = 0, lines = 1, got;
    const char *colon, *vs, *ve;
    while ((got = next_header(&s, &e, end, &colon, &vs, &ve)) != 0) {
        if (got < 0 || ++lines > MAX_LINES)
            return defer(pairs);
        Py_ssize_t nn = colon - s;
        if (is_word(s, nn, "transfer-encoding") || is_word(s, nn, "content-encoding") || is_word(s, nn, "expect") ||
            is_word(s, nn, "upgrade"))
            return defer(pairs);
        if (is_word(s, nn, "content-length")) {
            if (length >= 0 || ve == vs || ve - vs > 15)
                return defer(pairs);
            long long v = 0;
            for (const char *p = vs; p < ve; p++) {
                if (*p < '0' || *p > '9')
                    return defer(pairs);
                v = v * 10 + (*p - '0');
            }
            length = v;
        } else if (is_word(s, nn, "connection") && !connection_tokens(vs, ve, &close)) {
            return defer(pairs);
        }
        if (append_pair(pairs, s, nn, vs, ve - vs) < 0) {
            Py_DECREF(pairs);
            return NULL;
        }
    }
    if (length < 0)
        return defer(pairs);
    return Py_BuildValue("(ONLO)", chat ? Py_True : Py_False, pairs, length, close ? Py_True : Py_False);
}

static PyObject *response_head(const char *s, const char *end)
{
    const char *e = line_end(s, end);
    /* "HTTP/1.x DDD", then the line's end or a space and the reason */
    if (e - s < 12 || memcmp(s, "HTTP/1.", 7) || (s[7] != '1' && s[7] != '0') || s[8] != ' ' ||
        (e - s > 12 && s[12] != ' '))
        return defer(NULL);
    int status = 0;
    for (int i = 9; i < 12; i++) {
        if (s[i] < '0' || s[i] > '9')
            return defer(NULL);
        status = status * 10 + (s[i] - '0');
    }
    if (status < 200 || status > 599)
        return defer(NULL);
    for (const char *q = s + 12; q < e; q++)
        if (!value_char[(unsigned char)*q])
            return defer(NULL);
    int http10 = s[7] == '0';
    PyObject *pairs = PyList_New(0);
    if (pairs == NULL)
        return NULL;
    int got, lines = 0;
    const char *colon, *vs, *ve;
    while ((got = next_header(&s, &e, end, &colon, &vs, &ve)) != 0) {
        if (got < 0 || ++lines > MAX_RESPONSE_LINES)
            return defer(pairs);
        if (append_pair(pairs, s, colon - s, vs, ve - vs) < 0) {
            Py_DECREF(pairs);
            return NULL;
        }
    }
    return Py_BuildValue("(iON)", status, http10 ? Py_True : Py_False, pairs);
}

PyObject *py_request_head(PyObject *Py_UNUSED(self), PyObject *args)
{
    const char *s;
    Py_ssize_t n;
    return PyArg_ParseTuple(args, "y#:request_head", &s, &n) ? request_head(s, s + n) : NULL;
}

PyObject *py_response_head(PyObject *Py_UNUSED(self), PyObject *args)
{
    const char *s;
    Py_ssize_t n;
    return PyArg_ParseTuple(args, "y#:response_head", &s, &n) ? response_head(s, s + n) : NULL;
}
