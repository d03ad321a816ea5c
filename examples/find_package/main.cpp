// Causal attention over a [B, S, H, D] float buffer through the torch-free C++ API, checked
// against a direct evaluation of softmax(q k^T * scale) v for one query row.
#include <vidattn/vidattn.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const int B = 1, S = 100, H = 2, D = 32;
  std::vector<float> q(B * S * H * D), k(q.size()), v(q.size()), out(q.size()), lse(B * H * S);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(rng);

  using vidattn::DType;
  vidattn::AttentionOptions options;
  options.causal = true;
  vidattn::attention_forward(vidattn::make_view(q.data(), DType::kFloat32, {B, S, H, D}),
                             vidattn::make_view(k.data(), DType::kFloat32, {B, S, H, D}),
                             vidattn::make_view(v.data(), DType::kFloat32, {B, S, H, D}),
                             vidattn::make_view(out.data(), DType::kFloat32, {B, S, H, D}),
                             vidattn::make_view(lse.data(), DType::kFloat32, {B, H, S}),
                             options);

  // Row i = 40 of head 1 sees keys 0..40.
  const int i = 40, h = 1;
  auto at = [&](const std::vector<float>& t, int s, int d) { return t[(s * H + h) * D + d]; };
  std::vector<double> p(i + 1);
  double max_logit = -INFINITY, sum = 0;
  for (int j = 0; j <= i; ++j) {
    double dot = 0;
    for (int d = 0; d < D; ++d) dot += double(at(q, i, d)) * at(k, j, d);
    p[j] = dot / std::sqrt(double(D));
    max_logit = std::max(max_logit, p[j]);
  }
  for (double& x : p) sum += (x = std::exp(x - max_logit));
  double max_err = 0;
  for (int d = 0; d < D; ++d) {
    double expect = 0;
    for (int j = 0; j <= i; ++j) expect += p[j] / sum * at(v, j, d);
    max_err = std::max(max_err, std::abs(expect - at(out, i, d)));
  }
  std::printf("vidattn %s example: causal attention row %d, max abs error %.2e\n",
              VIDATTN_VERSION_STRING, i, max_err);
  return max_err < 1e-4 ? 0 : 1;
}
