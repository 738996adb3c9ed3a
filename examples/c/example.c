/* An all-reduce from C. Build and run (after scripts/install-c.sh PREFIX, with
 * PKG_CONFIG_PATH=PREFIX/lib/pkgconfig):
 *   cc example.c $(pkg-config --cflags --libs oxccl) -Wl,-rpath,$(pkg-config --variable=libdir oxccl) -o example
 *   oxccl run -n 4 ./example
 */
#include <oxccl.h>
#include <stdio.h>

#define CHECK(call)                                                                    \
  do {                                                                                 \
    oxcclResult_t r_ = (call);                                                         \
    if (r_ != oxcclSuccess) {                                                          \
      fprintf(stderr, "%s: %s\n", oxcclGetErrorString(r_), oxcclGetLastError(NULL));  \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

int main(void) {
  oxcclComm_t comm;
  int rank, nranks;
  CHECK(oxcclCommInitFromEnv(&comm)); /* rank and world size from the launcher */
  CHECK(oxcclCommUserRank(comm, &rank));
  CHECK(oxcclCommCount(comm, &nranks));

  float grad[1000];
  for (int i = 0; i < 1000; i++) grad[i] = (float)(rank + 1);
  CHECK(oxcclAllReduce(grad, grad, 1000, oxcclFloat32, oxcclSum, comm)); /* in place */

  float want = nranks * (nranks + 1) / 2.0f;
  printf("rank %d of %d: grad[0] = %g (want %g)\n", rank, nranks, grad[0], want);
  CHECK(oxcclCommDestroy(comm));
  return grad[0] == want ? 0 : 1;
}
