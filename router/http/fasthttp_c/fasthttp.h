/* router.http._fasthttp: the lean HTTP/1.1 listener's and client's hot loops in C. Each function takes the common case
only and answers None (or takes nothing) for anything else, which the Python code it stands beside then decides:
that code stays the one definition of every case, and a differential test holds the two together.
Sources: module.c (the method table), chunks.c (router/http/client.py's chunked bodies), heads.c (router/http/server.py's
request heads, router/http/client.py's response heads). */
#ifndef FASTHTTP_H
#define FASTHTTP_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *py_scan_chunks(PyObject *self, PyObject *args);
PyObject *py_request_head(PyObject *self, PyObject *args);
PyObject *py_response_head(PyObject *self, PyObject *args);
void heads_init(void); /* the character tables request_head and response_head read */

#endif
