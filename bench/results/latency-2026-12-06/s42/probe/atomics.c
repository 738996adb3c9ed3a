#include <stdio.h>
#include <x86intrin.h>
int main(){ volatile int m=0; long x=0; unsigned long long t0=__rdtsc();
 for(int i=0;i<10000000;i++){ int e=0; __atomic_compare_exchange_n(&m,&e,1,0,__ATOMIC_ACQUIRE,__ATOMIC_RELAXED); x+=i; __atomic_exchange_n(&m,0,__ATOMIC_RELEASE);} 
 unsigned long long t1=__rdtsc();
 for(int i=0;i<10000000;i++){ __atomic_fetch_add(&x,1,__ATOMIC_RELAXED); }
 unsigned long long t2=__rdtsc();
 printf("lock+unlock %.1f cyc, fetch_add %.1f cyc\n",(t1-t0)/1e7,(t2-t1)/1e7); }
