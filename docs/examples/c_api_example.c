/* c_api_example.c: spillway's C ABI from C (docs/integration.md, "The C ABI").
 *
 *   cc c_api_example.c -I<spillway>/torch_plugin -L<build>/torch_plugin -lspillway_alloc \
 *      -Wl,-rpath,<build>/torch_plugin -o c_api_example
 *   SPILLWAY_CONF=backend:sim,budget:64MiB ./c_api_example
 *
 * With backend:sim it needs no GPU. (ctest builds and runs it: test example_c_api.) */
#include <stdint.h>
#include <stdio.h>

#include "spillway_alloc.h"

int main(void) {
  void* p = spillway_try_malloc((size_t)1 << 20, 0, NULL); /* 1 MiB on device 0, default stream */
  if (p == NULL) {
    fprintf(stderr, "%s\n", spillway_last_error());
    return 1;
  }

  spillway_stats s;
  if (spillway_get_stats(0, &s, sizeof s) != 0) {
    fprintf(stderr, "%s\n", spillway_last_error());
    return 1;
  }
  printf("allocated %llu bytes, reserved %llu, budget %llu\n", (unsigned long long)s.allocated_bytes,
         (unsigned long long)s.reserved_bytes, (unsigned long long)s.budget);

  /* More than the budget: refused with NULL, and the reason. */
  if (s.budget != UINT64_MAX && spillway_try_malloc((size_t)s.budget, 0, NULL) == NULL)
    printf("refused: %s\n", spillway_last_error());

  spillway_free(p, 0, 0, NULL);
  spillway_empty_cache();
  return 0;
}
