#include "routing/versions.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>

typedef struct vkey {
    int32_t stage;
    uint8_t id[ROUTE_ID_LEN];
} vkey;

typedef struct ventry {
    vkey key;             /* zero-padded: hashed and compared as bytes */
    uint64_t hi;          /* highest version seen since the last rollback */
    uint64_t conn;        /* the connection that brought hi */
    UT_hash_handle hh;
} ventry;

struct route_versions {
    ventry *map;
};

route_versions *route_versions_create(void)
{
    return calloc(1, sizeof(route_versions));
}

int route_versions_observe(route_versions *v, int stage, const uint8_t id[ROUTE_ID_LEN], uint64_t conn,
                           uint64_t version, uint64_t *from_out)
{
    if (!v || !id || stage < 0)
        return -EINVAL;
    vkey key;
    memset(&key, 0, sizeof key);
    key.stage = stage;
    memcpy(key.id, id, ROUTE_ID_LEN);
    ventry *e = NULL;
    HASH_FIND(hh, v->map, &key, sizeof key, e);
    if (!e) {
        e = calloc(1, sizeof *e);
        if (!e)
            return -ENOMEM;
        e->key = key;
        e->hi = version;
        e->conn = conn;
        HASH_ADD(hh, v->map, key, sizeof e->key, e);
        return 0;
    }
    if (conn == e->conn) {
        if (version > e->hi)
            e->hi = version;
        return 0;
    }
    /* Another connection: the record restarts from this reply. */
    uint64_t from = e->hi;
    e->hi = version;
    e->conn = conn;
    if (version >= from)
        return 0;
    if (from_out)
        *from_out = from;
    return 1;
}

void route_versions_destroy(route_versions **pv)
{
    if (!pv || !*pv)
        return;
    ventry *e, *tmp;
    HASH_ITER(hh, (*pv)->map, e, tmp)
    {
        HASH_DEL((*pv)->map, e);
        free(e);
    }
    free(*pv);
    *pv = NULL;
}
