/* A peer that leaves: rank 1 exits after a barrier; rank 0's next all-reduce must return
 * oxcclRemoteError (or oxcclTimeout) with a message naming rank 1, the communicator's async
 * error must say the same, later calls fail at once, and destroying it still works. Prints
 * "ok   the peer's exit was reported" on rank 0. Run with 2 ranks. */
#include <oxccl.h>

#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(void) {
  oxcclComm_t comm;
  int rank;
  if (oxcclCommInitFromEnv(&comm) != oxcclSuccess) {
    printf("FAIL init: %s\n", oxcclGetLastError(NULL));
    return 1;
  }
  oxcclCommUserRank(comm, &rank);
  if (oxcclBarrier(comm) != oxcclSuccess) {
    printf("FAIL barrier: %s\n", oxcclGetLastError(NULL));
    return 1;
  }
  if (rank == 1) _exit(0); /* gone without a word */
  float x[1024] = {0};
  oxcclResult_t r = oxcclAllReduce(x, x, 1024, oxcclFloat32, oxcclSum, comm);
  const char *msg = oxcclGetLastError(NULL);
  printf("all-reduce returned %d (%s): %s\n", r, oxcclGetErrorString(r), msg);
  int named = strstr(msg, "rank 1") != NULL && strstr(msg, "oxcclAllReduce(count=1024") != NULL;
  oxcclResult_t async = oxcclSuccess;
  oxcclCommGetAsyncError(comm, &async);
  oxcclResult_t again = oxcclAllReduce(x, x, 1024, oxcclFloat32, oxcclSum, comm);
  oxcclResult_t destroyed = oxcclCommDestroy(comm);
  int ok = (r == oxcclRemoteError || r == oxcclTimeout) && named && async == r && again == r &&
           destroyed == oxcclSuccess;
  printf("%s the peer's exit was reported (async %d, again %d, destroy %d)\n", ok ? "ok  " : "FAIL",
         async, again, destroyed);
  return ok ? 0 : 1;
}
