// The 8-bit codec and its segments (comm_hooks/compression/int8_codec.h,
// int8_exchange.h). See Note [Adaptive precision] and Note [Eight bits at
// any world size].
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "comm_hooks/compression/int8_codec.h"
#include "comm_hooks/compression/int8_exchange.h"

namespace ddp_ext::compression {
namespace {

at::Tensor encode(at::Tensor& values, int64_t chunk) {
  at::Tensor payload = at::empty({int8_payload_bytes(values.numel(), chunk)}, at::kByte);
  encode_int8(values, payload, chunk);
  return payload;
}

// Codes plus what they miss give the values back, and what they miss is at
// most half a step (the chunk's largest magnitude / 127).
TEST(Int8Codec, CodesPlusWhatTheyMissGiveTheValuesBack) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 4}, {10, 4}, {4096, 1024}, {1000, 1024}, {5000, 7}};
  for (const auto& [numel, chunk] : shapes) {
    at::manual_seed(numel);
    const at::Tensor original = at::randn({numel}) * at::logspace(-3, 3, numel);
    at::Tensor values = original.clone();
    const at::Tensor payload = encode(values, chunk);
    const int64_t chunks = (numel + chunk - 1) / chunk;
    EXPECT_EQ(payload.numel(), 4 * chunks + numel);
    at::Tensor decoded = at::zeros({numel});
    decode_sum_int8({payload}, decoded, chunk);
    EXPECT_TRUE(at::allclose(decoded + values, original, 1e-6, 0)) << numel << "/" << chunk;
    const at::Tensor padded = at::constant_pad_nd(original.abs(), {0, chunks * chunk - numel});
    const at::Tensor step =
        std::get<0>(padded.view({chunks, chunk}).max(1)).repeat_interleave(chunk).slice(0, 0, numel) / 127;
    EXPECT_TRUE((values.abs() <= step * 0.5 * (1 + 1e-5)).all().item<bool>()) << numel << "/" << chunk;
  }
}

TEST(Int8Codec, ZeroChunksAndSumsOfPayloads) {
  at::Tensor values = at::zeros({8});
  values.slice(0, 4) = at::tensor({1.0f, -2.0f, 0.5f, 127.0f});
  at::Tensor a = values.clone();
  at::Tensor b = values * 3;
  const std::vector<at::Tensor> payloads = {encode(a, 4), encode(b, 4)};
  at::Tensor out = at::full({8}, std::numeric_limits<float>::quiet_NaN());
  decode_sum_int8(payloads, out, 4);
  EXPECT_TRUE(at::allclose(out + a + b, values * 4));
  EXPECT_TRUE((out.slice(0, 0, 4) == 0).all().item<bool>());
}

// A chunk whose largest magnitude / 127 is no normal float is sent as zeros
// and kept whole: 1 / scale would overflow and make the codes and what they
// miss NaN. Error feedback drives a chunk whose inputs stay zero there.
TEST(Int8Codec, ChunksTooSmallToScaleAreKeptWhole) {
  const float tiny = std::numeric_limits<float>::min();  // smallest normal float
  at::Tensor values = at::tensor({tiny, -tiny * 3, 0.0f, tiny / 8,  // largest / 127 < normal
                                  1.0f, 0.5f, -1.0f, 0.0f});
  const at::Tensor original = values.clone();
  at::Tensor out = at::empty({8});
  decode_sum_int8({encode(values, 4)}, out, 4);
  EXPECT_TRUE(at::isfinite(values).all().item<bool>());
  EXPECT_TRUE((out.slice(0, 0, 4) == 0).all().item<bool>());
  EXPECT_TRUE(at::equal(values.slice(0, 0, 4), original.slice(0, 0, 4)));
  EXPECT_TRUE(at::allclose(out.slice(0, 4) + values.slice(0, 4), original.slice(0, 4)));
}

template <typename Call>
std::string error_of(Call call) {
  try {
    call();
  } catch (const c10::Error& error) {
    return error.what();
  }
  return "no error";
}

TEST(Int8Codec, RefusesWhatItCannotEncode) {
  EXPECT_NE(error_of([] {
              at::Tensor doubles = at::zeros({4}, at::kDouble);
              encode(doubles, 4);
            }).find("1-D float32"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              at::Tensor out = at::zeros({8});
              decode_sum_int8({at::zeros({11}, at::kByte)}, out, 4);
            }).find("uint8 tensor of 16 bytes"),
            std::string::npos);
}

TEST(Int8Exchange, SegmentsAreWholeChunksThatCoverTheBucket) {
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> cases = {
      {3000, 1024, 2}, {3000, 1024, 4} /* one rank owns nothing */, {3000, 1024, 5},
      {10, 4, 3}, {4097, 64, 5}, {1, 1024, 4}, {0, 16, 3}};
  for (const auto& [numel, chunk, world] : cases) {
    const Int8Segments s = int8_segments(numel, chunk, world);
    ASSERT_EQ(s.begin.size(), static_cast<size_t>(world));
    int64_t end = 0;
    int64_t fewest = std::numeric_limits<int64_t>::max(), most = 0;
    for (int64_t r = 0; r < world; ++r) {
      EXPECT_EQ(s.begin[r], end) << "segments are contiguous and in rank order";
      EXPECT_TRUE(s.begin[r] % chunk == 0 || s.numel[r] == 0);
      end += s.numel[r];
      const int64_t chunks = (s.numel[r] + chunk - 1) / chunk;
      EXPECT_EQ(s.bytes[r], 4 * chunks + s.numel[r]);
      EXPECT_EQ(s.offset[r] % 4, 0);
      const int64_t slot = (s.bytes[r] + 3) / 4 * 4;
      EXPECT_LE(s.offset[r] + slot, s.total_bytes);
      EXPECT_LE(slot, s.largest_slot);
      fewest = std::min(fewest, chunks);
      most = std::max(most, chunks);
    }
    EXPECT_EQ(end, numel);
    EXPECT_LE(most - fewest, 1) << "segments as even as chunks allow";
  }
}

TEST(Int8Exchange, TheRuleKeepsTheAllgatherUpToThreeRanks) {
  for (int64_t world = 1; world <= 8; ++world) {
    EXPECT_STREQ(int8_exchange_name(int8_exchange_for(world)),
                 world <= 3 ? "allgather" : "reduce_scatter");
  }
}

} // namespace
} // namespace ddp_ext::compression
