// dtensor_demo — shards a small model's parameters over the ranks with DTensor, prints each
// rank's shard shapes, then reassembles one parameter with full_tensor().
//
//   fsdprun --standalone --nproc-per-node 2 build/examples/dtensor_demo
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>

#include <torch/torch.h>

#include <iostream>
#include <sstream>

namespace {

// Runs `print` on each rank in turn, so the lines come out in rank order.
template <typename F>
void in_rank_order(F&& print) {
  auto world = fsdp::world();
  for (int r = 0; r < world->size(); ++r) {
    if (r == world->rank()) {
      print();
      std::cout << std::flush;
    }
    world->barrier()->wait();
  }
}

}  // namespace

int main() {
  fsdp::init_process_group();
  const int rank = fsdp::get_rank(), world = fsdp::get_world_size();
  auto mesh = fsdp::init_device_mesh("cpu", {world}, {"dp"});

  torch::manual_seed(0);  // the same initial weights on every rank
  torch::nn::Sequential model(torch::nn::Linear(4, 5), torch::nn::ReLU(), torch::nn::Linear(5, 3));

  std::vector<std::pair<std::string, fsdp::DTensor>> shards;
  for (const auto& item : model->named_parameters()) {
    shards.emplace_back(item.key(), fsdp::distribute_tensor(item.value().detach(), mesh, {fsdp::Shard(0)}));
  }
  if (rank == 0) std::cout << "mesh: " << mesh.str() << "\n";
  in_rank_order([&] {
    for (const auto& s : shards) {
      const auto b = s.second.local_bounds()[0];
      std::ostringstream line;
      line << "rank " << rank << ": " << s.first << " global " << c10::IntArrayRef(s.second.sizes()) << " "
           << s.second.placements()[0].str() << " -> local " << s.second.to_local().sizes() << " (rows " << b.offset
           << ".." << b.offset + b.length << ")\n";
      std::cout << line.str();
    }
  });

  // Reassemble every parameter and compare with the original.
  bool all_equal = true;
  at::Tensor shown;
  for (size_t i = 0; i < shards.size(); ++i) {
    at::Tensor full = shards[i].second.full_tensor();
    all_equal = all_equal && full.equal(model->named_parameters()[shards[i].first].detach());
    if (shards[i].first == "2.weight") shown = full;
  }
  if (rank == 0) {
    std::cout << "reassembled 2.weight with full_tensor():\n" << shown << "\n";
    std::cout << "every parameter reassembles to the original: " << (all_equal ? "yes" : "NO") << std::endl;
  }
  fsdp::destroy_process_group();
  return all_equal ? 0 : 1;
}
