/* O_DIRECT writes from contiguous and from scattered anonymous memory, with
 * the block device's request count and size (virtio-blk: /sys/block/vda/stat),
 * in C, without aionvme: 16 MiB pwrite calls, one at a time, then fdatasync.
 *
 *   cc -O2 -o /tmp/scatter_write bench/c/scatter_write.c
 *   /tmp/scatter_write /var/tmp/sw.bin 1024 0    # MiB; 0: pages faulted first to last
 *   /tmp/scatter_write /var/tmp/sw.bin 1024 1    # 1: MADV_HUGEPAGE
 *   /tmp/scatter_write /var/tmp/sw.bin 1024 2    # 2: pages faulted last to first (scattered)
 *
 * The device's counters are the whole device's: run it on an idle machine.
 * The statistics file is /sys/block/vda/stat; pass another as the 4th argument. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <time.h>
static const char *STAT = "/sys/block/vda/stat";
static void stat_(long *ios, long *sec){FILE*f=fopen(STAT,"r");if(!f){perror(STAT);exit(1);}long v[11];for(int i=0;i<11;i++)fscanf(f,"%ld",&v[i]);fclose(f);*ios=v[4];*sec=v[6];}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  if(argc<4){fprintf(stderr,"usage: %s FILE MIB MODE [STATFILE]\n",argv[0]);return 2;}
  if(argc>4)STAT=argv[4];
  size_t total=(size_t)atol(argv[2])<<20, chunk=16<<20; int huge=atoi(argv[3]);
  char*buf=mmap(0,total+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  if(buf==MAP_FAILED){perror("mmap");return 1;}
  buf=(char*)(((unsigned long)buf+(2<<20)-1)&~((2UL<<20)-1));
  if(huge==1)madvise(buf,total,MADV_HUGEPAGE); else madvise(buf,total,MADV_NOHUGEPAGE);
  if(huge==2){ /* touch pages in reverse order */ for(long i=total-4096;i>=0;i-=4096)buf[i]=1; }
  memset(buf,7,total);
  int fd=open(argv[1],O_WRONLY|O_CREAT|O_TRUNC|O_DIRECT,0644);
  if(fd<0){perror(argv[1]);return 1;}
  long i0,s0,i1,s1; sync(); stat_(&i0,&s0); double t=now();
  for(size_t off=0;off<total;off+=chunk) if(pwrite(fd,buf+off,chunk,off)!=chunk){perror("pwrite");return 1;}
  fdatasync(fd); double dt=now()-t; stat_(&i1,&s1);
  printf("huge=%d %.2f GB/s ios=%ld avg_req=%.0f KiB\n",huge,total/dt/1e9,i1-i0,(s1-s0)*512.0/(i1-i0)/1024);
  close(fd); unlink(argv[1]); return 0;}
