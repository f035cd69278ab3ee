# Script mode: see tests/consumer/CMakeLists.txt.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(LAST_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

run(${CMAKE_COMMAND} --install ${SINEW_BUILD_DIR} --prefix ${WORK_DIR}/staged)
file(RENAME ${WORK_DIR}/staged ${WORK_DIR}/moved)
foreach(f include/sinew/collectives/communicator.h include/sinew/config.h
    include/sinew/runtime/trainer.h include/sinew/pipeline/template_planner.h bin/sinew-run)
  if(NOT EXISTS ${WORK_DIR}/moved/${f})
    message(FATAL_ERROR "installed package lacks ${f}")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/moved -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
if(NOT LAST_OUTPUT MATCHES "consumer ok: allreduce=3")
  message(FATAL_ERROR "consumer printed unexpected output: ${LAST_OUTPUT}")
endif()
message(STATUS "${LAST_OUTPUT}")
