/* A GGUF string array's layout: each string follows its 64-bit little-endian byte count. Walking
   it is a chain of dependent reads (where string i + 1 starts depends on string i's count), a few
   hundred thousand of them for a large vocabulary: one loop here instead of one Python iteration
   a string. */
#include <stdint.h>

/* ends[i] = the byte after string i, for `count` strings from `pos`; returns the position after
   the last one, or -(i + 1) when string i's count field or its bytes would pass `size`. */
int64_t edgellm_gguf_string_ends(const uint8_t *buf, int64_t size, int64_t pos, int64_t count, int64_t *ends) {
    for (int64_t i = 0; i < count; i++) {
        if (pos < 0 || pos > size - 8) return -(i + 1);
        const uint8_t *p = buf + pos;
        uint64_t n = 0;
        for (int b = 7; b >= 0; b--) n = n << 8 | p[b];
        if (n > (uint64_t)(size - pos - 8)) return -(i + 1);
        pos += 8 + (int64_t)n;
        ends[i] = pos;
    }
    return pos;
}

/* Whether buf[start, end) is well-formed UTF-8 as Python's decoder reads it: no overlong forms,
   no surrogates, nothing past U+10FFFF. */
static int utf8_valid(const uint8_t *s, const uint8_t *end) {
    while (s < end) {
        uint8_t c = *s;
        if (c < 0x80) { s++; continue; }
        int more;
        uint8_t lo = 0x80, hi = 0xBF;  /* the allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF) more = 1;
        else if (c >= 0xE0 && c <= 0xEF) more = 2, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        else if (c >= 0xF0 && c <= 0xF4) more = 3, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        else return 0;
        if (end - s <= more || s[1] < lo || s[1] > hi) return 0;
        for (int k = 2; k <= more; k++)
            if ((s[k] & 0xC0) != 0x80) return 0;
        s += more + 1;
    }
    return 1;
}

/* The first of `count` strings (buf[starts[i], ends[i])) that is not UTF-8, or -1. */
int64_t edgellm_first_bad_utf8(const uint8_t *buf, const int64_t *starts, const int64_t *ends, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (!utf8_valid(buf + starts[i], buf + ends[i])) return i;
    return -1;
}
