/* Checkpoint reader for safetensors files.
 *
 * Each file is mapped read-only and its header validated once, here, so that downstream code can
 * trust every tensor it is handed: dtype known, shape sane, bytes inside the data area and equal
 * to numel x dtype size, no two tensors sharing bytes, no name held twice across shards.
 *
 * Choices:
 * - The header is copied into a NUL-terminated buffer before parsing, so that trailing bytes other
 *   than the whitespace padding writers add are rejected rather than silently ignored.
 * - Gaps between tensors are accepted (the format's writers never leave any, but they do no harm);
 *   overlaps are not.
 * - A tensor whose bytes are not aligned to its element size in the mapping (a writer that did not
 *   pad the header to 8 bytes) is copied to an aligned heap buffer, because the kernels index
 *   float and uint16_t pointers directly. checkpoint_close tells copies from mapped views by
 *   whether the pointer lies inside the file's mapping.
 * - The tensor array of all files is sorted by name once at the end; duplicates are then
 *   neighbours, and checkpoint_find is a binary search. */
#include "config/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/log.h"

#define SAFETENSORS_INDEX_NAME "model.safetensors.index.json"
#define SAFETENSORS_SUFFIX     ".safetensors"

/* JSON numbers are doubles: integers are exact up to 2^53, which bounds every offset and dim. */
#define JSON_MAX_EXACT_INT 9007199254740992.0

/* One tensor of one file while its header is being checked. */
typedef struct {
    char *name;
    tensor t;
    uint64_t begin, end; /* data_offsets, relative to the data area */
} header_entry;

static bool json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0.0 && d <= JSON_MAX_EXACT_INT) || d != floor(d)) return false;
    *out = (uint64_t)d;
    return true;
}

/* Check one header entry {dtype, shape, data_offsets} against the data area of data_size bytes. */
static int parse_entry(const cJSON *item, uint64_t data_size, header_entry *e, const char *path,
                       char *err, size_t errlen) {
    const char *name = item->string;
    if (!cJSON_IsObject(item))
        return set_err(err, errlen, "%s: tensor '%s': header entry is not a JSON object", path,
                       name);

    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    if (!dt) return set_err(err, errlen, "%s: tensor '%s': dtype is missing", path, name);
    if (!cJSON_IsString(dt))
        return set_err(err, errlen, "%s: tensor '%s': dtype is not a string", path, name);
    if (!dtype_parse(dt->valuestring, &e->t.dtype))
        return set_err(err, errlen, "%s: tensor '%s': unknown dtype \"%s\"", path, name,
                       dt->valuestring);

    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    if (!shape) return set_err(err, errlen, "%s: tensor '%s': shape is missing", path, name);
    if (!cJSON_IsArray(shape))
        return set_err(err, errlen, "%s: tensor '%s': shape is not an array", path, name);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > TENSOR_MAX_DIMS)
        return set_err(err, errlen,
                       "%s: tensor '%s': shape has %d dimensions, at most %d supported", path, name,
                       ndim, TENSOR_MAX_DIMS);
    e->t.ndim = ndim;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape) {
        uint64_t v;
        if (!json_uint(d, &v))
            return set_err(err, errlen, "%s: tensor '%s': shape[%d] is not a non-negative integer",
                           path, name, i);
        e->t.shape[i++] = (int64_t)v;
    }

    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!offs) return set_err(err, errlen, "%s: tensor '%s': data_offsets is missing", path, name);
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 ||
        !json_uint(cJSON_GetArrayItem(offs, 0), &e->begin) ||
        !json_uint(cJSON_GetArrayItem(offs, 1), &e->end))
        return set_err(err, errlen,
                       "%s: tensor '%s': data_offsets is not a pair of non-negative integers", path,
                       name);
    if (e->begin > e->end)
        return set_err(err, errlen,
                       "%s: tensor '%s': data_offsets [%llu, %llu) end before they begin", path,
                       name, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > data_size)
        return set_err(err, errlen,
                       "%s: tensor '%s': data_offsets [%llu, %llu) run past the end of the data "
                       "area (%llu bytes; file truncated?)",
                       path, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                       (unsigned long long)data_size);

    /* numel x size is compared with a span already known to lie inside the file, so an
     * overflowing product can only mean a mismatch; check it rather than wrap. */
    uint64_t need = dtype_size(e->t.dtype);
    bool overflow = false;
    for (int k = 0; k < ndim; k++)
        overflow |= __builtin_mul_overflow(need, (uint64_t)e->t.shape[k], &need);
    if (overflow || need != e->end - e->begin) {
        char shp[256];
        tensor_format_shape(shp, sizeof shp, e->t.ndim, e->t.shape);
        if (overflow)
            return set_err(err, errlen, "%s: tensor '%s': shape %s of %s overflows 64 bits", path,
                           name, shp, dtype_name(e->t.dtype));
        return set_err(err, errlen,
                       "%s: tensor '%s': data_offsets [%llu, %llu) hold %llu bytes but shape %s of "
                       "%s needs %llu",
                       path, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                       (unsigned long long)(e->end - e->begin), shp, dtype_name(e->t.dtype),
                       (unsigned long long)need);
    }
    e->t.device = DEVICE_CPU;
    return 0;
}

static int entry_cmp_offset(const void *a, const void *b) {
    const header_entry *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Parse and check the header of one mapped file; on success *out holds n entries whose names the
 * caller owns. */
static int parse_header(const unsigned char *base, size_t file_size, uint64_t header_len,
                        const char *path, header_entry **out, int *n_out, char *err,
                        size_t errlen) {
    uint64_t data_size = file_size - 8 - header_len;
    char *text = xmalloc(header_len + 1);
    memcpy(text, base + 8, header_len);
    text[header_len] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, header_len + 1, &end, 1);
    if (!root) {
        size_t at = end ? (size_t)(end - text) : 0;
        free(text);
        return set_err(err, errlen, "%s: header is not valid JSON (error at header byte %zu)", path,
                       at);
    }
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return set_err(err, errlen, "%s: header is not a JSON object", path);
    }

    int cap = cJSON_GetArraySize(root), n = 0;
    header_entry *es = xcalloc(cap > 0 ? (size_t)cap : 1, sizeof *es);
    const cJSON *item;
    int rc = 0;
    cJSON_ArrayForEach(item, root) {
        if (strcmp(item->string, "__metadata__") == 0) continue;
        if (parse_entry(item, data_size, &es[n], path, err, errlen) != 0) {
            rc = -1;
            break;
        }
        es[n].name = xstrdup(item->string);
        n++;
    }
    cJSON_Delete(root);

    if (rc == 0 && n > 1) {
        qsort(es, (size_t)n, sizeof *es, entry_cmp_offset);
        /* After sorting by start, a tensor overlaps some earlier one exactly when it starts before
         * the furthest end seen so far. Empty tensors own no bytes and cannot overlap. */
        int last = -1;
        for (int i = 0; i < n && rc == 0; i++) {
            if (es[i].begin == es[i].end) continue;
            if (last >= 0 && es[i].begin < es[last].end)
                rc = set_err(err, errlen,
                             "%s: tensor '%s': data_offsets [%llu, %llu) overlap tensor '%s' at "
                             "[%llu, %llu)",
                             path, es[i].name, (unsigned long long)es[i].begin,
                             (unsigned long long)es[i].end, es[last].name,
                             (unsigned long long)es[last].begin, (unsigned long long)es[last].end);
            if (last < 0 || es[i].end > es[last].end) last = i;
        }
    }
    if (rc != 0) {
        for (int i = 0; i < n; i++)
            free(es[i].name);
        free(es);
        return -1;
    }
    *out = es;
    *n_out = n;
    return 0;
}

/* Map one file, check its header and append the file and its tensors to ck. On failure ck is left
 * as it was, so the caller can still close it. */
static int load_file(checkpoint *ck, const char *path, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return set_err(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return set_err(err, errlen, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return set_err(err, errlen, "%s: not a regular file", path);
    }
    size_t size = (size_t)st.st_size;
    if (size < 8) {
        close(fd);
        return set_err(err, errlen, "%s: file is %zu bytes, too short for the 8-byte header length",
                       path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return set_err(err, errlen, "%s: cannot mmap: %s", path, strerror(map_errno));
    const unsigned char *base = map;

    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--)
        header_len = header_len << 8 | base[i];
    int rc = 0;
    if (header_len > SAFETENSORS_MAX_HEADER)
        rc = set_err(err, errlen, "%s: header length %llu exceeds the %u-byte limit", path,
                     (unsigned long long)header_len, SAFETENSORS_MAX_HEADER);
    else if (header_len > size - 8)
        rc =
            set_err(err, errlen, "%s: header length %llu runs past the end of the file (%zu bytes)",
                    path, (unsigned long long)header_len, size);
    header_entry *es = NULL;
    int n = 0;
    if (rc == 0) rc = parse_header(base, size, header_len, path, &es, &n, err, errlen);
    if (rc != 0) {
        munmap(map, size);
        return -1;
    }

    int fi = ck->n_files;
    ck->file_paths = xrealloc(ck->file_paths, (size_t)(fi + 1) * sizeof *ck->file_paths);
    ck->maps = xrealloc(ck->maps, (size_t)(fi + 1) * sizeof *ck->maps);
    ck->map_sizes = xrealloc(ck->map_sizes, (size_t)(fi + 1) * sizeof *ck->map_sizes);
    ck->file_paths[fi] = xstrdup(path);
    ck->maps[fi] = map;
    ck->map_sizes[fi] = size;
    ck->n_files = fi + 1;

    ck->tensors = xrealloc(ck->tensors, (size_t)(ck->n_tensors + n) * sizeof *ck->tensors);
    const unsigned char *data = base + 8 + header_len;
    for (int i = 0; i < n; i++) {
        checkpoint_tensor *ct = &ck->tensors[ck->n_tensors++];
        ct->name = es[i].name;
        ct->t = es[i].t;
        ct->file = ck->file_paths[fi];
        const unsigned char *p = data + es[i].begin;
        size_t nbytes = (size_t)(es[i].end - es[i].begin);
        if (nbytes > 0 && (uintptr_t)p % dtype_size(ct->t.dtype) != 0) {
            void *copy = xmalloc(nbytes); /* malloc alignment covers every dtype */
            memcpy(copy, p, nbytes);
            ct->t.data = copy;
        } else {
            ct->t.data = (void *)p;
        }
    }
    free(es);
    return 0;
}

static int tensor_cmp_name(const void *a, const void *b) {
    return strcmp(((const checkpoint_tensor *)a)->name, ((const checkpoint_tensor *)b)->name);
}

/* Sort by name and reject a name held twice (within one file or across shards). */
static int finish(checkpoint *ck, char *err, size_t errlen) {
    if (ck->n_tensors > 1)
        qsort(ck->tensors, (size_t)ck->n_tensors, sizeof *ck->tensors, tensor_cmp_name);
    for (int i = 1; i < ck->n_tensors; i++) {
        const checkpoint_tensor *a = &ck->tensors[i - 1], *b = &ck->tensors[i];
        if (strcmp(a->name, b->name) != 0) continue;
        if (a->file == b->file)
            return set_err(err, errlen, "%s: tensor '%s' appears twice in the header", a->file,
                           a->name);
        return set_err(err, errlen, "%s: tensor '%s' is also in %s", b->file, b->name, a->file);
    }
    return 0;
}

int checkpoint_open_file(checkpoint *ck, const char *path, char *err, size_t errlen) {
    memset(ck, 0, sizeof *ck);
    if (load_file(ck, path, err, errlen) != 0 || finish(ck, err, errlen) != 0) {
        checkpoint_close(ck);
        return -1;
    }
    return 0;
}

static int str_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Read the index: open each distinct file of weight_map once, then check that every name it maps
 * is in the file it names. */
static int open_indexed(checkpoint *ck, const char *dir, const char *index_path, char *err,
                        size_t errlen) {
    FILE *f = fopen(index_path, "rb");
    if (!f) return set_err(err, errlen, "%s: cannot open: %s", index_path, strerror(errno));
    size_t cap = 1 << 16, len = 0;
    char *text = xmalloc(cap);
    for (;;) {
        len += fread(text + len, 1, cap - len - 1, f);
        if (len < cap - 1) break;
        cap *= 2;
        text = xrealloc(text, cap);
    }
    bool read_error = ferror(f);
    fclose(f);
    if (read_error) {
        free(text);
        return set_err(err, errlen, "%s: read error", index_path);
    }
    text[len] = '\0';
    cJSON *root = cJSON_ParseWithLengthOpts(text, len + 1, NULL, 1);
    free(text);
    if (!root) return set_err(err, errlen, "%s: not valid JSON", index_path);

    int rc = 0;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(root) || !wm) {
        rc = set_err(err, errlen, "%s: weight_map is missing", index_path);
    } else if (!cJSON_IsObject(wm)) {
        rc = set_err(err, errlen, "%s: weight_map is not an object", index_path);
    }

    int n_names = rc == 0 ? cJSON_GetArraySize(wm) : 0, n_files = 0;
    char **files = xcalloc(n_names > 0 ? (size_t)n_names : 1, sizeof *files);
    const cJSON *item;
    if (rc == 0) {
        cJSON_ArrayForEach(item, wm) {
            if (!cJSON_IsString(item) || item->valuestring[0] == '\0') {
                rc = set_err(err, errlen, "%s: weight_map['%s'] is not a file name", index_path,
                             item->string);
                break;
            }
            files[n_files++] = item->valuestring;
        }
    }
    if (rc == 0 && n_files == 0) rc = set_err(err, errlen, "%s: weight_map is empty", index_path);
    if (rc == 0) {
        qsort(files, (size_t)n_files, sizeof *files, str_cmp);
        for (int i = 0; i < n_files && rc == 0; i++) {
            if (i > 0 && strcmp(files[i], files[i - 1]) == 0) continue;
            char *path = path_join(dir, files[i]);
            if (load_file(ck, path, err, errlen) != 0) {
                /* Say where the missing or broken file was named. */
                size_t used = err && errlen ? strlen(err) : errlen;
                if (used + 1 < errlen)
                    snprintf(err + used, errlen - used, " (named by %s)", index_path);
                rc = -1;
            }
            free(path);
        }
    }
    if (rc == 0) rc = finish(ck, err, errlen);
    if (rc == 0) {
        cJSON_ArrayForEach(item, wm) {
            char *path = path_join(dir, item->valuestring);
            const checkpoint_tensor *ct = checkpoint_find(ck, item->string);
            if (!ct)
                rc = set_err(err, errlen,
                             "%s: tensor '%s' is mapped to %s, which does not hold it (nor does "
                             "any other shard)",
                             index_path, item->string, path);
            else if (strcmp(ct->file, path) != 0)
                rc = set_err(err, errlen,
                             "%s: tensor '%s' is mapped to %s, which does not hold it (%s does)",
                             index_path, item->string, path, ct->file);
            free(path);
            if (rc != 0) break;
        }
    }
    free(files);
    cJSON_Delete(root);
    return rc;
}

static bool has_suffix(const char *s, const char *suffix) {
    size_t ns = strlen(s), nx = strlen(suffix);
    return ns > nx && strcmp(s + ns - nx, suffix) == 0;
}

/* No index: every *.safetensors in dir, in name order so that errors are reproducible. */
static int open_all(checkpoint *ck, const char *dir, char *err, size_t errlen) {
    DIR *d = opendir(dir);
    if (!d) return set_err(err, errlen, "%s: cannot open folder: %s", dir, strerror(errno));
    int n = 0, cap = 8;
    char **names = xmalloc((size_t)cap * sizeof *names);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        /* Dot files are editor and OS litter (._model.safetensors), not shards. */
        if (de->d_name[0] == '.' || !has_suffix(de->d_name, SAFETENSORS_SUFFIX)) continue;
        if (n == cap) names = xrealloc(names, (size_t)(cap *= 2) * sizeof *names);
        names[n++] = xstrdup(de->d_name);
    }
    closedir(d);
    int rc = 0;
    if (n == 0)
        rc = set_err(err, errlen, "%s: no *.safetensors files and no %s", dir,
                     SAFETENSORS_INDEX_NAME);
    qsort(names, (size_t)n, sizeof *names, str_cmp);
    for (int i = 0; i < n && rc == 0; i++) {
        char *path = path_join(dir, names[i]);
        rc = load_file(ck, path, err, errlen);
        free(path);
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (rc == 0) rc = finish(ck, err, errlen);
    return rc;
}

int checkpoint_open(checkpoint *ck, const char *dir, char *err, size_t errlen) {
    memset(ck, 0, sizeof *ck);
    char *index_path = path_join(dir, SAFETENSORS_INDEX_NAME);
    int rc = access(index_path, F_OK) == 0 ? open_indexed(ck, dir, index_path, err, errlen)
                                           : open_all(ck, dir, err, errlen);
    free(index_path);
    if (rc != 0) {
        checkpoint_close(ck);
        return -1;
    }
    LOG_DEBUG("checkpoint", "%s: %d tensors in %d files", dir, ck->n_tensors, ck->n_files);
    return 0;
}

const checkpoint_tensor *checkpoint_find(const checkpoint *ck, const char *name) {
    int lo = 0, hi = ck->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(ck->tensors[mid].name, name);
        if (c == 0) return &ck->tensors[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

/* Whether a tensor's data is a heap copy (see load_file) rather than a view into its file's
 * mapping. Empty tensors are never copied; their pointer may sit at the very end of the map. */
static bool is_heap_copy(const checkpoint *ck, const checkpoint_tensor *ct) {
    if (!ct->t.data || tensor_nbytes(&ct->t) == 0) return false;
    for (int i = 0; i < ck->n_files; i++) {
        if (ck->file_paths[i] != ct->file) continue;
        const char *lo = ck->maps[i], *p = ct->t.data;
        return !(p >= lo && p < lo + ck->map_sizes[i]);
    }
    return false;
}

void checkpoint_close(checkpoint *ck) {
    for (int i = 0; i < ck->n_tensors; i++) {
        if (is_heap_copy(ck, &ck->tensors[i])) free(ck->tensors[i].t.data);
        free(ck->tensors[i].name);
    }
    for (int i = 0; i < ck->n_files; i++) {
        munmap(ck->maps[i], ck->map_sizes[i]);
        free(ck->file_paths[i]);
    }
    free(ck->tensors);
    free(ck->file_paths);
    free(ck->maps);
    free(ck->map_sizes);
    memset(ck, 0, sizeof *ck);
}
