"""Distributed RNN: embedding and decoder on a parameter server, LSTM on the trainer,
trained with distributed autograd and the distributed optimizer."""
