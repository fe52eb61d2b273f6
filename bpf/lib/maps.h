/* How programs reach the maps declared in maps.c: by the file descriptor the loader passes.
 *
 * bcc rewrites `table.lookup(&key)` into a map access only inside a program's main file, and
 * the logic of this datapath lives in shared headers. So the loader first loads maps.c (which
 * creates or re-opens the pinned maps), then compiles each program with -DEPX_FD_<map>=<fd>;
 * EPX_MAP(name) turns that descriptor into the map reference the verifier expects.
 * A program compiled without a descriptor it uses fails to compile, naming the macro.
 */
#ifndef EPX_MAPS_H
#define EPX_MAPS_H

#include "lib/common.h"

#define EPX_MAP(name) ((void *)bpf_pseudo_fd(1, EPX_FD_##name))
#define epx_lookup(name, key) bpf_map_lookup_elem(EPX_MAP(name), key)
#define epx_update(name, key, val) bpf_map_update_elem(EPX_MAP(name), key, val, BPF_ANY)
#define epx_insert(name, key, val) bpf_map_update_elem(EPX_MAP(name), key, val, BPF_NOEXIST)
#define epx_delete(name, key) bpf_map_delete_elem(EPX_MAP(name), key)

#endif /* EPX_MAPS_H */
