"""Expert parallelism by hand (correct): a mixture-of-experts layer with one expert per rank (moe.py's layer, 2
experts on 2 ranks, one ``nn.Linear`` each). Each rank routes its share of the batch's tokens (top-1 of a softmax
gate), sends each expert's tokens to the rank that holds it with all_to_all_single (split sizes exchanged first),
runs its own expert on what it receives, and sends the results back the same way; the gradients of what every rank
holds (embedding, gate, head) are all-reduced, each expert's gradient stays on its rank. The single process holds
every expert and runs them one after the other on the tokens routed to each."""
import moe

moe.main(moe.Looped, experts=2)
