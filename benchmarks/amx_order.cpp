// Establishes TDPBF16PS arithmetic on an AMX CPU: a million outputs of adversarial inputs (narrow and wide exponent
// spread, a non-zero C, near-denormal values) against candidate orders; "C+(ev+od)" is the one with no mismatch
// (csrc/linear_common.h). Build and run: g++ -O2 -march=native benchmarks/amx_order.cpp -o /tmp/amx_order && /tmp/amx_order
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <random>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) Cfg { uint8_t palette=1, start=0; uint8_t r[14]={}; uint16_t colsb[16]={}; uint8_t rows[16]={}; };
static inline float bf(uint16_t h){ uint32_t u=uint32_t(h)<<16; float f; memcpy(&f,&u,4); return f; }
static inline uint32_t bits(float f){ uint32_t u; memcpy(&u,&f,4); return u; }
static inline float daz(float f){ return std::fpclassify(f)==FP_SUBNORMAL ? std::copysign(0.f,f) : f; }
int main(int argc, char** argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg c; for(int t=0;t<8;++t){c.colsb[t]=64;c.rows[t]=16;} _tile_loadconfig(&c);
  std::mt19937 g(1);
  long mism[6]={0}; long mm[4][6]={{0}}; long total=0;
  for(int trial=0; trial<4000; ++trial){
    alignas(64) uint16_t A[16][32], B[16][32]; alignas(64) float C[16][16], C0[16][16];
    int mode = trial % 4;
    for(int i=0;i<16;++i) for(int j=0;j<32;++j){
      auto rnd=[&](int spread){ int e = 127 + (int(g()%(2*spread+1)) - spread); if(mode==3 && g()%8==0) e = g()%3; // denormal-ish
        uint32_t m = g() & 0x7f; uint32_t s = (g()&1)<<15; if(e<=0) e=0; if(e>254) e=254; return uint16_t(s | (e<<7) | m); };
      int sp = mode==0?4: mode==1?30: mode==2?60: 20;
      A[i][j]=rnd(sp); B[i][j]=rnd(sp);
    }
    for(int i=0;i<16;++i) for(int j=0;j<16;++j){ C0[i][j] = (mode==1)? float((g()%2001)-1000)*(1<<(g()%20)) : 0.f; C[i][j]=C0[i][j]; }
    _tile_loadd(0, C, 64); _tile_loadd(1, A, 64); _tile_loadd(2, B, 64);
    _tile_dpbf16ps(0,1,2); _tile_stored(0, C, 64);
    // A: 16 rows m x 16 pairs k; B: 16 rows k x 16 pairs n. C[m][n] += sum_k A[m][2k..2k+1] . B[k][2n..2n+1]
    for(int m=0;m<16;++m) for(int n=0;n<16;++n){
      float e[6];
      auto P=[&](int k){ return daz(bf(A[m][k]))*daz(bf(B[k/2][2*n+(k&1)])); };
      float ev=0, od=0; for(int k=0;k<16;++k){ ev=ev+P(2*k); od=od+P(2*k+1);} 
      e[0]=C0[m][n] + (ev+od);
      e[1]=(C0[m][n]+ev)+od;
      e[2]=float(double(C0[m][n])+double(ev)+double(od));
      double dev=0, dod=0; for(int k=0;k<16;++k){ dev+=P(2*k); dod+=P(2*k+1);} 
      e[3]=C0[m][n] + (float(dev)+float(dod));
      e[4]=float(double(C0[m][n]) + double(float(dev))+double(float(dod)));
      float ev2=C0[m][n], od2=0; for(int k=0;k<16;++k){ ev2=ev2+P(2*k); od2=od2+P(2*k+1);} e[5]=ev2+od2;
      for(int q=0;q<6;++q){ bool x= bits(daz(e[q])) != bits(C[m][n]); mism[q]+=x; mm[mode][q]+=x;}
      ++total;
    }
  }
  _tile_release();
  printf("total %ld\n", total);
  const char* names[6]={"C+(ev+od)","(C+ev)+od","exact C+ev+od","C+(dev+dod) dbl chains","exact C+f(dev)+f(dod)","C in even chain"};
  for(int q=0;q<6;++q) printf("%-28s mismatches %ld  by mode %ld %ld %ld %ld\n", names[q], mism[q], mm[0][q],mm[1][q],mm[2][q],mm[3][q]);
}
