/* expert/rope.c: rotary position embeddings, Hugging Face's rotate-half
 * layout (see ops.h), and their tables. */
#include "expert/ops.h"

#include <errno.h>
#include <math.h>

int expert_rope_tables(float *cos_t, float *sin_t, int T, int hd, double theta)
{
    if (!cos_t || !sin_t || T < 1 || hd < 2 || hd % 2 || !(theta > 0))
        return -EINVAL;
    int h = hd / 2;
    for (int i = 0; i < h; i++) {
        double inv = 1.0 / pow(theta, (double)(2 * i) / (double)hd);
        for (int p = 0; p < T; p++) {
            double a = (double)p * inv;
            cos_t[(size_t)p * (size_t)h + (size_t)i] = (float)cos(a);
            sin_t[(size_t)p * (size_t)h + (size_t)i] = (float)sin(a);
        }
    }
    return 0;
}

int expert_rope(float *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int hd, int inverse)
{
    if (!x || !cos_t || !sin_t || N < 0 || T < 1 || heads < 1 || hd < 2 || hd % 2)
        return -EINVAL;
    int h = hd / 2;
    for (int n = 0; n < N; n++) {
        const float *c = cos_t + (size_t)(n % T) * (size_t)h, *s = sin_t + (size_t)(n % T) * (size_t)h;
        for (int k = 0; k < heads; k++) {
            float *u = x + ((size_t)n * (size_t)heads + (size_t)k) * (size_t)hd;
            for (int i = 0; i < h; i++) {
                float a = u[i], b = u[i + h], sn = inverse ? -s[i] : s[i];
                /* torch: x·cos + rotate_half(x)·sin, each product rounded. */
                float ac = a * c[i], bs = b * sn, bc = b * c[i], as = a * sn;
                u[i] = ac - bs;
                u[i + h] = bc + as;
            }
        }
    }
    return 0;
}
