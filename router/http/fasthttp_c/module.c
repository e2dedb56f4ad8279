/* router.http._fasthttp: the module's method table (fasthttp.h lists the sources). */
#include "fasthttp.h"

static PyMethodDef methods[] = {
    {"scan_chunks", py_scan_chunks, METH_VARARGS,
     "scan_chunks(data, pos) -> (pos, payload): the complete canonical chunks from pos, their data joined"},
    {"request_head", py_request_head, METH_VARARGS,
     "request_head(head) -> (chat, [(name, value)], content_length, close), or None: router.http.server.parse_head decides"},
    {"response_head", py_response_head, METH_VARARGS,
     "response_head(head) -> (status, http_1_0, [(name, value)]), or None: router.http.client's Python parse decides"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_fasthttp", .m_doc = "The lean HTTP/1.1 hot loops, in C.", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fasthttp(void)
{
    heads_init();
    return PyModule_Create(&module);
}
